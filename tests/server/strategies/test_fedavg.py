"""FedAvg: every device trains the same model; the new global model is the data-weighted mean (METHODS §1.2)."""

from __future__ import annotations

import torch

from nestling.server.strategies import DeviceInfo, create_strategy


def devices(n: int) -> list[DeviceInfo]:
    return [DeviceInfo(f"dev-{i:05d}", i, 10 * (i + 1)) for i in range(n)]


def test_every_device_gets_the_same_full_model(make_ctx) -> None:
    strategy = create_strategy("fedavg", make_ctx())
    tasks = strategy.assign(3, devices(3))
    assert len({t.spec_id for t in tasks.values()}) == 1
    for task in tasks.values():
        assert task.procedure == "sgd" and task.round == 3
        assert all(torch.equal(task.weights[k], strategy.global_state[k]) for k in strategy.global_state)
        assert task.hparams["lr"] > 0 and "seed" in task.hparams


def test_aggregation_is_the_sample_weighted_mean_of_all_tensors(make_ctx, fake_result) -> None:
    strategy = create_strategy("fedavg", make_ctx())
    tasks = list(strategy.assign(0, devices(3)).values())
    sizes = [10, 30, 60]
    results = [fake_result(t, seed=i, num_samples=n) for i, (t, n) in enumerate(zip(tasks, sizes))]
    strategy.aggregate(0, list(zip(tasks, results)))
    for key, value in strategy.global_state.items():
        if value.is_floating_point():
            expected = sum(n * r.weights[key] for n, r in zip(sizes, results)) / sum(sizes)
            torch.testing.assert_close(value, expected, msg=key)


def test_aggregation_does_not_depend_on_the_order_results_arrived_in(make_ctx, fake_result) -> None:
    a = create_strategy("fedavg", make_ctx())
    b = create_strategy("fedavg", make_ctx())
    tasks = list(a.assign(0, devices(4)).values())
    pairs = [(t, fake_result(t, seed=i, num_samples=7 + i)) for i, t in enumerate(tasks)]
    a.aggregate(0, pairs)
    b.aggregate(0, pairs[::-1])
    for key in a.global_state:
        torch.testing.assert_close(a.global_state[key], b.global_state[key], rtol=1e-6, atol=1e-7)


def test_the_same_seed_builds_the_same_initial_model(make_ctx) -> None:
    a, b = create_strategy("fedavg", make_ctx(seed=4)), create_strategy("fedavg", make_ctx(seed=4))
    c = create_strategy("fedavg", make_ctx(seed=5))
    assert all(torch.equal(a.global_state[k], b.global_state[k]) for k in a.global_state)
    assert not torch.equal(a.global_state["stem.conv.weight"], c.global_state["stem.conv.weight"])


def test_narrow_fedavg_trains_and_evaluates_one_width_slice(make_ctx, fake_result) -> None:
    strategy = create_strategy("fedavg", make_ctx(options={"width": 0.5}))
    (task,) = strategy.assign(0, devices(1)).values()
    assert task.weights["stem.conv.weight"].shape[0] == 4
    before = strategy.global_state["stem.conv.weight"].clone()
    strategy.aggregate(0, [(task, fake_result(task))])
    assert torch.equal(strategy.global_state["stem.conv.weight"][4:], before[4:])
    (target,) = strategy.eval_targets()
    assert target.name == "w0.5" and target.spec.width == 0.5
