"""HeteroFL (METHODS §7.1): width rates, Scaler only in training, static BN, label-masked classifier rows."""

from __future__ import annotations

import pytest
import torch

from nestling.errors import ConfigError
from nestling.messages import Task
from nestling.models import known_models
from nestling.models.layers import Scaler
from nestling.server.evaluation import Evaluator
from nestling.server.strategies import DeviceInfo, create_strategy
from nestling.server.strategies.heterofl import HeteroFL, parse_rate_mix


def heterofl(make_ctx, **options) -> HeteroFL:
    strategy = create_strategy("heterofl", make_ctx(num_clients=10, options=options))
    assert isinstance(strategy, HeteroFL)
    return strategy


def devices(n: int = 10, labels=None) -> list[DeviceInfo]:
    return [DeviceInfo(f"dev-{i:05d}", i, 20, labels=None if labels is None else labels[i]) for i in range(n)]


def test_rate_mix_parses_letters_and_shares() -> None:
    assert parse_rate_mix("a1-b1-c2") == [(1.0, 0.25), (0.5, 0.25), (0.25, 0.5)]
    assert parse_rate_mix("e1") == [(0.0625, 1.0)]
    for bad in ("x1", "a", "a1-bb"):
        with pytest.raises(ConfigError, match="bad HeteroFL rate mix"):
            parse_rate_mix(bad)


def test_rates_go_widest_first_unless_listed_order_is_asked(make_ctx) -> None:
    rates = [0.25, 0.5, 1.0, 0.125, 0.0625]
    widest = [heterofl(make_ctx, rates=rates).spec_for(0, d).width for d in devices()]
    assert widest == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.125, 0.125, 0.0625, 0.0625]
    listed = [heterofl(make_ctx, rates=rates, order="listed").spec_for(0, d).width for d in devices()]
    assert listed == [0.25, 0.25, 0.5, 0.5, 1.0, 1.0, 0.125, 0.125, 0.0625, 0.0625]
    with pytest.raises(ConfigError, match="HeteroFL order must be 'widest-first' or 'listed', got 'up'"):
        heterofl(make_ctx, order="up")


def test_fix_mode_gives_contiguous_client_blocks_their_rate(make_ctx) -> None:
    strategy = heterofl(make_ctx, mix="a1-b1-c1-d1-e1")
    rates = [strategy.spec_for(0, d).width for d in devices()]
    assert rates == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.125, 0.125, 0.0625, 0.0625]
    assert all(strategy.spec_for(5, d) == strategy.spec_for(0, d) for d in devices())


def test_dynamic_mode_redraws_rates_reproducibly(make_ctx) -> None:
    strategy = heterofl(make_ctx, mode="dynamic")
    per_round = [[strategy.spec_for(r, d).width for d in devices()] for r in range(6)]
    assert per_round == [[strategy.spec_for(r, d).width for d in devices()] for r in range(6)]
    assert len({tuple(rates) for rates in per_round}) > 1


def test_all_rate_one_clients_aggregate_to_uniform_fedavg(make_ctx, fake_result) -> None:
    strategy = heterofl(make_ctx, mix="a1")
    tasks = strategy.assign(0, devices(3))
    results = [fake_result(t, seed=i, num_samples=5 + 20 * i) for i, t in enumerate(tasks.values())]
    strategy.aggregate(0, list(zip(tasks.values(), results)))
    for key, value in strategy.global_state.items():
        if value.is_floating_point():
            torch.testing.assert_close(value, torch.stack([r.weights[key] for r in results]).mean(0), msg=key)


def test_elements_are_count_averaged_over_the_rates_that_hold_them(make_ctx, fake_result) -> None:
    strategy = heterofl(make_ctx, mix="a1-b1")
    tasks = list(strategy.assign(0, [devices()[0], devices()[9]]).values())  # one rate-1, one rate-0.5 client
    results = [fake_result(t, seed=i) for i, t in enumerate(tasks)]
    strategy.aggregate(0, list(zip(tasks, results)))
    full, half = results
    w = strategy.global_state["blocks.0.conv1.weight"]
    torch.testing.assert_close(
        w[:4, :4], (full.weights["blocks.0.conv1.weight"][:4, :4] + half.weights["blocks.0.conv1.weight"]) / 2
    )
    torch.testing.assert_close(w[4:], full.weights["blocks.0.conv1.weight"][4:])


@pytest.mark.parametrize("arch", known_models())
def test_masked_class_rows_are_untouched_by_clients_lacking_the_class(make_ctx, fake_result, arch) -> None:
    """In every family (the classifier is found by what it is, not by its name)."""
    strategy = create_strategy(
        "heterofl", make_ctx(arch=arch, num_clients=10, options={"mix": "a1", "masked_ce": True})
    )
    labels = {0: (0, 1), 1: (1, 2)}
    before = strategy.global_state["head.fc.weight"].clone(), strategy.global_state["head.fc.bias"].clone()
    tasks = strategy.assign(0, devices(2, labels))
    assert [t.hparams["label_set"] for t in tasks.values()] == [[0, 1], [1, 2]]
    assert all(t.hparams["masked_ce"] for t in tasks.values())
    a, b = (fake_result(t, seed=i) for i, t in enumerate(tasks.values()))
    strategy.aggregate(0, list(zip(tasks.values(), (a, b))))
    for key, old in zip(("head.fc.weight", "head.fc.bias"), before):
        new = strategy.global_state[key]
        torch.testing.assert_close(new[0], a.weights[key][0])  # only client a holds class 0
        torch.testing.assert_close(new[1], (a.weights[key][1] + b.weights[key][1]) / 2)
        torch.testing.assert_close(new[2], b.weights[key][2])
        assert torch.equal(new[3], old[3])  # nobody holds class 3
    # Rows of other tensors are not masked.
    others = [
        key
        for key, value in a.weights.items()
        if value.is_floating_point() and not key.startswith("head.fc.")
    ]
    assert others
    for key in others:
        torch.testing.assert_close(strategy.global_state[key], (a.weights[key] + b.weights[key]) / 2)


def test_local_training_uses_batch_statistics_and_a_train_only_scaler(make_ctx) -> None:
    strategy = heterofl(make_ctx)
    assert strategy.model.norm_stats == "batch" and strategy.model.scaler == "train"
    assert not any("running_mean" in k for k in strategy.global_state)
    scaler = Scaler(0.25, strategy.model.scaler)
    x = torch.ones(3)
    assert torch.equal(scaler.eval()(x), x)
    assert torch.equal(scaler.train()(x), x * 4)


@pytest.fixture
def evaluator() -> Evaluator:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 8, 8, generator=generator)
    return Evaluator(x, torch.arange(64) % 4, batch_size=64, calibration=x)


def test_static_bn_pass_recomputes_statistics_but_never_changes_weights(
    make_ctx, evaluator: Evaluator
) -> None:
    strategy = heterofl(make_ctx)
    for target in strategy.eval_targets():
        assert target.static_bn
        model = evaluator.model_for(target)
        for key, value in model.state_dict().items():
            if key in target.state:
                assert torch.equal(value, target.state[key]), key
            else:
                assert "running_" in key or "num_batches" in key
        assert any(
            float(v.abs().sum()) > 0 for k, v in model.state_dict().items() if k.endswith("running_mean")
        )


def test_static_bn_statistics_are_those_of_the_activations_seen_at_evaluation(
    make_ctx, evaluator: Evaluator
) -> None:
    """After sBN over X (one batch), eval-mode outputs on X equal batch-statistics outputs on X (up to the
    unbiased-variance factor): the statistics must be gathered with the Scaler as it acts at evaluation."""
    strategy = heterofl(make_ctx)
    x = evaluator.calibration
    for target in strategy.eval_targets():
        model = evaluator.model_for(target)
        with torch.no_grad():
            model.eval()
            evaluated = model(x)
            model.train()
            batch_stats = model(x)
        torch.testing.assert_close(evaluated, batch_stats, rtol=0.05, atol=0.05, msg=target.name)


def test_task_carries_only_the_rate_slice(make_ctx) -> None:
    strategy = heterofl(make_ctx, mix="a1-b1-c1-d1-e1")
    tasks: dict[str, Task] = strategy.assign(0, devices())
    small = tasks["dev-00009"]
    assert small.weights["blocks.1.conv1.weight"].shape[:2] == (1, 1)  # ceil(16/16) of tinycnn's 16 channels
    assert small.weights["stem.conv.weight"].shape == (1, 3, 3, 3)
