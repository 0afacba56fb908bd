"""Bounded influence (server/influence.py): a sample-count claim buys at most a bounded share of a round."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch

from nestling.data import make_partition
from nestling.messages import Result, Task
from nestling.server.influence import bound_influence, capped_weights, sample_bound, share_cap

REPO = Path(__file__).resolve().parents[2]


def _pair(device: str, claimed: int) -> tuple[Task, Result]:
    weights = {"w": torch.zeros(2)}
    task = Task(round=0, device_id=device, spec={}, weights=weights, procedure="train", task_id=f"t-{device}")
    result = Result(
        round=0, device_id=device, task_id=f"t-{device}", spec_id="s", num_samples=claimed, weights=weights
    )
    return task, result


def test_a_consistent_lie_counts_as_a_typical_board_and_within_the_share() -> None:
    pairs = [_pair("liar", 10**9)] + [_pair(f"d{i}", 180) for i in range(9)]
    bounded = bound_influence(pairs, [10**9] + [180] * 9, 3.0, 0.3)
    kept = [r.num_samples for _, r in bounded.accepted]
    assert kept[0] == 180 and kept[1:] == [180] * 9  # the fleet's median (the liar does not move it)
    claimed, samples, why = bounded.changed["t-liar"]
    assert (claimed, samples) == (10**9, 180) and "counted as that median" in why
    # a claim at the bound is still believed: only what no honest board of the presets reaches is not
    at_bound = bound_influence([_pair("big", 540), *pairs[1:]], [540] + [180] * 9, 3.0, 0.3)
    assert at_bound.changed == {}
    over = bound_influence([_pair("big", 541), *pairs[1:]], [541] + [180] * 9, 3.0, 0.3)
    assert over.accepted[0][1].num_samples == 180
    assert bounded.accepted[1][1] is pairs[1][1]  # honest results are the very objects they were


def test_the_share_cap_lowers_the_largest_together_and_holds() -> None:
    weights = capped_weights([1000.0, 900.0, 100.0, 100.0, 100.0, 100.0, 100.0, 100.0], 0.3)
    assert (
        max(weights) <= 0.3 * sum(weights) + 1e-9 and weights[0] == weights[1] and weights[2:] == [100.0] * 6
    )
    assert capped_weights([1.0, 2.0, 3.0], 0.3) == [1.0, 1.0, 1.0]  # only equal shares come close


def test_small_rounds_allow_twice_an_equal_share_and_no_bound_means_no_change() -> None:
    assert (
        share_cap(3, 0.3) == pytest.approx(2 / 3) and share_cap(2, 0.3) == 1.0 and share_cap(10, 0.3) == 0.3
    )
    assert share_cap(10, None) == 1.0 and sample_bound([100, 200], None) == math.inf
    pairs = [_pair("a", 10**9), _pair("b", 1)]
    assert bound_influence(pairs, [1, 1], None, None).accepted == pairs


def test_honest_rounds_are_left_exactly_as_they_were() -> None:
    pairs = [_pair(f"d{i}", n) for i, n in enumerate([591, 300, 307, 115, 420, 250, 330, 298, 310, 301])]
    bounded = bound_influence(pairs, [n for _, r in pairs for n in [r.num_samples]], 3.0, 0.3)
    assert bounded.changed == {} and all(a[1] is b[1] for a, b in zip(bounded.accepted, pairs, strict=True))


def _presets() -> list[tuple[str, str, dict, int, float, int]]:
    """(preset/scale, scheme, options, clients, fraction, training samples) of every reproduction preset."""
    found = []
    for path in sorted((REPO / "examples" / "reproduce").glob("*.toml")):
        spec = tomllib.loads(path.read_text())
        for scale, setting in spec.get("scales", {}).items():
            data, train = setting["data"], setting["train"]
            options = {k: data[k] for k in ("alpha",) if k in data and data["partition"] != "iid"}
            found.append(
                (
                    f"{path.stem}/{scale}",
                    data["partition"],
                    options,
                    int(data["clients"]),
                    float(train["fraction"]),
                    int(data.get("limit_train", 50000)),
                )
            )
    return found


@pytest.mark.parametrize("preset, scheme, options, clients, fraction, samples", _presets())
def test_no_honest_board_of_any_reproduction_preset_is_ever_bounded(
    preset: str, scheme: str, options: dict, clients: int, fraction: float, samples: int
) -> None:
    """The presets' partitions (CIFAR-10's balanced labels; three seeds) and 300 drawn rounds each: no board is
    over 3x its fleet's median nor over its round's share, so the defaults change no honest weight."""
    labels = np.repeat(np.arange(10), samples // 10)
    per_round = max(1, math.floor(fraction * clients))
    for seed in (0, 1, 2):
        sizes = [len(p) for p in make_partition(scheme, labels, clients, seed, **options)]
        rng = np.random.default_rng(seed)
        for _ in range(300):
            picked = rng.choice(clients, size=per_round, replace=False)
            pairs = [_pair(f"d{i}", sizes[i]) for i in picked]
            assert bound_influence(pairs, sizes, 3.0, 0.3).changed == {}, preset
