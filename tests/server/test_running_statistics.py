"""BN running statistics judged by their values: measured per round (one layout at a time), refused when wrong on
their own or far above the round's others for the same tensor, and never for leaving their initial values."""

from __future__ import annotations

import math
from statistics import median

import numpy as np
import pytest
import torch

from nestling.messages import Result, Task
from nestling.server.flat_updates import flat_update
from nestling.server.running_statistics import (
    MeasuredStatistics,
    UploadedStatistics,
    measure,
    quantile_without,
    statistics_outliers,
)
from nestling.server.screening import RobustPolicy, outliers


def uploaded(**tensors: torch.Tensor) -> UploadedStatistics:
    return UploadedStatistics(tuple(k.replace("__", ".") for k in tensors), tuple(tensors.values()))


def test_measure_gives_each_tensors_rms_for_results_of_every_layout() -> None:
    """Results of two layouts (nested widths) and one without statistics, measured in one call."""
    generator = torch.Generator().manual_seed(0)
    narrow = uploaded(
        bn__running_mean=torch.randn(4, generator=generator), bn__running_var=torch.rand(4) + 0.5
    )
    wide = uploaded(bn__running_mean=torch.randn(8, generator=generator), bn__running_var=torch.rand(8) + 0.5)
    empty = UploadedStatistics((), ())
    measured = measure([narrow, wide, empty, narrow])
    for stats, result in zip((narrow, wide, empty, narrow), measured, strict=True):
        expected = tuple(float(t.double().norm()) / math.sqrt(t.numel()) for t in stats.tensors)
        assert result.keys == stats.keys and result.rms == pytest.approx(expected, rel=1e-12)
        assert result.problem is None


@pytest.mark.parametrize(
    "mean, var, named",
    [
        (float("nan"), 1.0, "non-finite BN running statistic bn.running_mean"),
        (0.0, 3.0e38, "BN running statistic bn.running_var beyond float32 range when squared (rms 3e+38)"),
        (0.0, -0.5, "negative BN running variance in bn.running_var"),
    ],
)
def test_statistics_wrong_on_their_own_are_named(mean: float, var: float, named: str) -> None:
    bad = uploaded(bn__running_mean=torch.full((4,), mean), bn__running_var=torch.full((4,), var))
    honest = uploaded(bn__running_mean=torch.zeros(4), bn__running_var=torch.ones(4))
    measured = measure([honest, bad])
    assert measured[0].problem is None and measured[1].problem == named
    assert statistics_outliers(measured, 10.0) == {}  # judged on its own, left out of the comparison


def test_a_zero_sized_tensor_measures_as_zero() -> None:
    stats = uploaded(a__running_mean=torch.zeros(0), b__running_var=torch.full((4,), 4.0))
    assert measure([stats])[0].rms == pytest.approx((0.0, 4.0))


def _measured(values: dict[str, float]) -> MeasuredStatistics:
    return MeasuredStatistics(tuple(values), tuple(values.values()))


def test_inflated_running_statistics_are_refused_tensor_by_tensor() -> None:
    """Nested boards' statistics differ a little; a board multiplying one running variance by 1000 is refused
    and named; a tensor only one board holds is not judged."""
    honest = [
        _measured({"bn1.running_var": 1.3, "bn2.running_var": 2.0}),
        _measured({"bn1.running_var": 0.9, "bn2.running_var": 1.6}),
        _measured({"bn1.running_var": 1.1, "bn2.running_var": 2.4, "bn3.running_var": 50.0}),
    ]
    assert statistics_outliers(honest, 10.0) == {}
    attacker = _measured({"bn1.running_var": 1.0, "bn2.running_var": 1900.0})
    refused = statistics_outliers([*honest, attacker], 10.0)
    assert list(refused) == [3]
    assert (  # others' upper quartile, judged in standard deviations: sqrt(1900 / 2.2) = 29.4
        "bn2.running_var rms 1.9e+03 against the round's reference 2.2: 29.4x in standard deviations, over 10x"
        in refused[3]
    )


@pytest.mark.parametrize("together", [True, False])
def test_a_running_variance_is_judged_in_standard_deviations(together: bool) -> None:
    """The dynamicfl preset's seed 1 refused an honest board in round 1: its blocks.1.bn1 running variance had
    rms 48.2 against the others' 4.03 (12x, 3.5x in standard deviations), over the factor of 10 when compared
    as a variance. In standard deviations it is kept; 100x the others' variance and more is still refused.
    Both paths: measured together (the honest round's one-matrix shortcut) and key by key."""

    def board(scale: float, seed: int) -> UploadedStatistics:
        generator = torch.Generator().manual_seed(seed)
        var = 4.0 * (0.8 + 0.4 * torch.rand(16, generator=generator)) * scale
        mean = 0.3 * torch.randn(16, generator=generator) * math.sqrt(scale)
        keys = ("blocks.1.bn1.running_mean", "blocks.1.bn1.running_var")
        return UploadedStatistics(keys, (mean, var))

    def judged(boards: list[UploadedStatistics]) -> dict[int, str]:
        measured = measure(boards)
        if not together:  # the key-by-key path: results measured apart
            measured = [MeasuredStatistics(m.keys, m.rms, m.problem, m.changed) for m in measured]
        return statistics_outliers(measured, 10.0)

    honest = [board(1.0, seed) for seed in range(9)]
    assert judged([*honest, board(12.0, 9)]) == {}
    assert judged([*honest, board(90.0, 9)]) == {}  # 9.5x in standard deviations
    refused = judged([*honest, board(110.0, 9)])
    assert list(refused) == [9] and "running_var" in refused[9] and "in standard deviations" in refused[9]
    assert list(judged([*honest, board(1e4, 9)])) == [9]


def _bn_net() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 4 * 4, 4),
    )


def _train(net: torch.nn.Module, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    optimiser = torch.optim.SGD(net.parameters(), lr=0.01)
    net.train()
    for _ in range(steps):
        images = 3.0 + 2.0 * torch.randn(16, 3, 6, 6, generator=generator)  # far from BN's initial 0 / 1
        labels = torch.randint(0, 4, (16,), generator=generator)
        optimiser.zero_grad()
        torch.nn.functional.cross_entropy(net(images), labels).backward()
        optimiser.step()


def _round_trip(net: torch.nn.Module, steps: int, seed: int) -> tuple[Task, Result]:
    sent = {k: v.clone() for k, v in net.state_dict().items()}
    _train(net, steps, seed)
    task = Task(round=5, device_id="d", spec={}, weights=sent, procedure="sgd", task_id=f"t{seed}")
    trained = {k: v.clone() for k, v in net.state_dict().items()}
    return task, Result(
        round=5, device_id="d", task_id=f"t{seed}", spec_id="s", num_samples=16, weights=trained
    )


def test_the_first_update_of_a_never_trained_submodel_is_not_refused() -> None:
    """Real training: three boards train a model trained for 40 steps already; the fourth trains, in the same
    round, one nobody had trained (its BN statistics still at 0 / 1). Measured with its statistics, its update
    is over 10x the others' (the screen refused it before); over its trained weights it is like theirs, and
    its statistics' values are like theirs."""
    pairs = []
    for seed in range(3):
        torch.manual_seed(0)
        veteran = _bn_net()
        _train(veteran, 40, seed=99)
        pairs.append(_round_trip(veteran, 3, seed))
    torch.manual_seed(1)
    pairs.append(_round_trip(_bn_net(), 3, seed=3))

    def rms_with_statistics(task: Task, result: Result) -> float:
        deltas = [
            (result.weights[k] - v).reshape(-1) for k, v in task.weights.items() if v.is_floating_point()
        ]
        flat = torch.cat(deltas)
        return float(flat.norm()) / math.sqrt(flat.numel())

    before = [rms_with_statistics(*pair) for pair in pairs]
    assert before[3] > 10 * median(before[:3])
    updates = [flat_update(*pair) for pair in pairs]
    assert outliers([u.size for u in updates], RobustPolicy()) == {}
    measured = measure([u.statistics for u in updates])
    assert all(m.problem is None for m in measured)
    assert statistics_outliers(measured, RobustPolicy().update_norm_factor) == {}


@pytest.mark.parametrize("q", [0.5, 0.75])
def test_the_quantile_without_one_element_equals_the_quantile_of_the_rest_and_the_median_at_half(
    q: float,
) -> None:
    generator = torch.Generator().manual_seed(0)
    for count in range(2, 12):
        for _ in range(20):
            ordered = sorted(torch.rand(count, generator=generator).tolist())
            for position in range(count):
                rest = ordered[:position] + ordered[position + 1 :]
                assert quantile_without(ordered, position, q) == pytest.approx(float(np.quantile(rest, q)))
            assert quantile_without(ordered, None, q) == pytest.approx(float(np.quantile(ordered, q)))


def test_statistics_a_board_left_as_sent_are_not_compared() -> None:
    """FjORD: each board trains one width per step and sends the other widths' statistics as its task had them
    (0 / 1 until some board trains that width). Those unchanged tensors must not set the reference: the board
    that did train width 3 was refused ('rms 0.422 over 10x the round's median 0') every round."""

    def board(trained_width: int, mean: float) -> UploadedStatistics:
        sent = {f"bn.running_mean_w{j}": torch.zeros(4) for j in range(4)}
        sent.update({f"bn.running_var_w{j}": torch.ones(4) for j in range(4)})
        uploaded_values = dict(sent)
        uploaded_values[f"bn.running_mean_w{trained_width}"] = torch.full((4,), mean)
        uploaded_values[f"bn.running_var_w{trained_width}"] = torch.full((4,), 1.3)
        keys = tuple(sent)
        return UploadedStatistics(
            keys, tuple(uploaded_values[k] for k in keys), sent=tuple(sent[k] for k in keys)
        )

    boards = [board(0, 0.05), board(1, 0.04), board(2, 0.06), board(3, 0.422), board(0, 0.03)]
    measured = measure(boards)
    assert measured[3].changed == tuple(k.endswith("_w3") for k in measured[3].keys)
    assert statistics_outliers(measured, 10.0) == {}
    inflated = board(0, 0.04)
    inflated = UploadedStatistics(
        inflated.keys,
        tuple(t * 1.0e4 if k == "bn.running_var_w0" else t for k, t in zip(inflated.keys, inflated.tensors)),
        sent=inflated.sent,
    )
    refused = statistics_outliers(measure([*boards, inflated]), 10.0)
    assert list(refused) == [5] and "bn.running_var_w0" in refused[5]


def test_a_running_mean_is_measured_in_its_layers_standard_deviations() -> None:
    """Honest running means sit near 0, where ratios mean nothing (0.009 against others' 0.0009 is honest); a
    mean is refused only when it is over factor x the layer's typical standard deviation as well."""

    def stats(mean: float, var: float = 1.0) -> MeasuredStatistics:
        return _measured({"bn.running_mean": mean, "bn.running_var": var})

    honest = [stats(0.0009), stats(0.0008), stats(0.0011), stats(0.0095)]
    assert statistics_outliers(honest, 10.0) == {}
    refused = statistics_outliers([*honest, stats(40.0)], 10.0)
    assert list(refused) == [4] and "bn.running_mean rms 40 over 10x the round's reference 1" in refused[4]


def test_statistics_handed_over_as_one_vector_measure_as_their_tensors() -> None:
    """A packed result gives its statistics as one vector (`flat`) with their shapes: same rms, same problems."""
    tensors = (torch.randn(4), torch.rand(4) + 0.5, torch.zeros(0), torch.full((3,), -1.0))
    keys = ("a.running_mean", "a.running_var", "c.running_mean", "d.running_var")
    apart = UploadedStatistics(keys, tensors)
    together = UploadedStatistics(
        keys, tensors, flat=torch.cat(tensors), shapes=tuple(tuple(t.shape) for t in tensors)
    )
    measured_apart, measured_together = measure([apart, together])
    assert measured_together == measured_apart
    assert measured_apart.problem == "negative BN running variance in d.running_var"
