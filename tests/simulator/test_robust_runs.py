"""Screening and robust aggregation in the simulator (the same coordinator as a fleet): an honest run is
bit-identical with screening on, a bad board is refused, and robust rules run every nested strategy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.robustness import ATTACKS
from nestling.config import config_from_dict
from nestling.server.checkpoint import latest_checkpoint, load_checkpoint
from nestling.server.strategies import STRATEGIES
from nestling.simulator.run import run_simulation


def tiny(method: str = "fedavg", **run: object):
    return config_from_dict(
        {
            "run": {"rounds": 2, "seed": 3, "workers": 1, "eval_every": 2, "quorum": 0.6, **run},
            "data": {"dataset": "digits", "clients": 4, "limit_train": 400, "limit_test": 100},
            "model": {"arch": "tinycnn"},
            "method": {"name": method},
            "train": {"fraction": 1.0, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
        }
    )


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    path = latest_checkpoint(out / "checkpoints")
    assert path is not None
    return load_checkpoint(path)[0]


def test_an_honest_run_is_bit_identical_with_screening_on(tmp_path: Path) -> None:
    run_simulation(tiny(screen_updates=True, divergence_guard=True), tmp_path / "on")
    run_simulation(tiny(screen_updates=False, divergence_guard=False), tmp_path / "off")
    on, off = final_weights(tmp_path / "on"), final_weights(tmp_path / "off")
    assert on.keys() == off.keys() and all(torch.equal(on[k], off[k]) for k in on)


# The model each method needs to run at all (FeDepth's memory budgets, ScaleFL's four exits), else tinycnn.
MODEL_FOR = {
    "fedepth": ("preresnet20", {"budgets": "fair"}),
    "m-fedepth": ("preresnet20", {"budgets": "surplus"}),
    "scalefl": ("resnet20", {}),
}


@pytest.mark.parametrize("method", sorted(STRATEGIES))
def test_every_methods_honest_run_refuses_nothing_and_is_bit_identical_with_screening_on(
    method: str, tmp_path: Path
) -> None:
    """Each method's own uploads (FjORD's per-width statistics left as sent for widths a board did not train,
    FeDepth's partial uploads, FedTrans' several models, ...) pass the screens: nothing refused or clipped, and the
    same weights as with screening off. FjORD's boards were refused every round by the statistics screen before
    it left unchanged tensors out of the comparison."""
    arch, options = MODEL_FOR.get(method, ("tinycnn", {}))

    def config(screening: bool):
        return config_from_dict(
            {
                "run": {
                    "rounds": 2,
                    "seed": 3,
                    "workers": 1,
                    "eval_every": 0,
                    "quorum": 0.6,
                    "screen_updates": screening,
                    "divergence_guard": screening,
                },
                "data": {"dataset": "synthetic", "clients": 4, "limit_train": 96, "limit_test": 20},
                "model": {"arch": arch},
                "method": {"name": method, **options},
                "train": {"fraction": 1.0, "local_steps": 2, "batch_size": 16},
            }
        )

    run_simulation(config(True), tmp_path / "on")
    run_simulation(config(False), tmp_path / "off")
    records = [
        json.loads(line) for line in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines() if line
    ]
    acted = {
        k: v
        for r in records
        for k, v in r["counters"].items()
        if v and (k.startswith(("rejected_", "clipped", "bounded_")) or k == "rolled_back")
    }
    assert acted == {}, acted
    on, off = final_weights(tmp_path / "on"), final_weights(tmp_path / "off")
    assert on.keys() == off.keys() and all(torch.equal(on[k], off[k]) for k in on)


def test_a_huge_valued_board_is_refused_in_the_simulator(tmp_path: Path) -> None:
    summary = run_simulation(tiny(), tmp_path / "huge", tamper=ATTACKS["huge_values"].tamper)
    weights = final_weights(tmp_path / "huge")
    assert all(bool(torch.isfinite(v).all()) for v in weights.values() if v.is_floating_point())
    assert summary["quarantined"] == []


def test_a_board_inflating_bn_running_variances_is_refused(tmp_path: Path) -> None:
    """Honest weights, every running variance × 10^4: the update's norm over trained weights is honest, the
    statistics screen refuses it, and the model's variances stay where the honest boards put them."""
    run_simulation(tiny(rounds=2), tmp_path / "attacked", tamper=ATTACKS["inflated_bn_variance"].tamper)
    run_simulation(tiny(rounds=2), tmp_path / "honest")
    records = [
        json.loads(line) for line in (tmp_path / "attacked" / "metrics.jsonl").read_text().splitlines()
    ]
    assert sum(r["counters"].get("rejected_update_norm", 0) for r in records) >= 1
    attacked, honest = final_weights(tmp_path / "attacked"), final_weights(tmp_path / "honest")
    for key, value in attacked.items():
        if key.endswith("running_var"):
            assert float(value.max()) < 10 * float(honest[key].max()), key


@pytest.mark.parametrize("attack", ["bn_variance_x9", "bn_variance_zero", "bn_mean_8_sigma"])
def test_with_the_papers_mean_in_range_bn_poisoning_is_refused_every_round(
    tmp_path: Path, attack: str
) -> None:
    """Issue 25: inside the x10 screen (variances x9, 0; means +8 sigma) with honest weights, against 3 honest
    boards, BN statistics averaged as the papers do: refused every round by the cohort screen, named."""
    run_simulation(tiny(rounds=2, bn_statistics="mean"), tmp_path, tamper=ATTACKS[attack].tamper)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["counters"].get("rejected_update_norm", 0) for r in records] == [1, 1]
    assert all(r["aggregated"] and r["accepted"] == 3 for r in records)


def _statistics_moved(
    attacked: dict[str, torch.Tensor], honest: dict[str, torch.Tensor]
) -> tuple[float, float]:
    """How far an attacked run's BN statistics ended from the honest run's: the largest, over tensors, median
    over channels of the variance ratio (as a factor >= 1) and of the mean's shift in honest deviations."""
    ratios, shifts = [1.0], [0.0]
    for key, value in attacked.items():
        if key.endswith("running_var"):
            ratio = (value.clamp_min(1e-12) / honest[key].clamp_min(1e-12)).median()
            ratios.append(float(torch.maximum(ratio, 1 / ratio)))
        elif key.endswith("running_mean"):
            scale = honest[key.replace("running_mean", "running_var")].clamp_min(1e-12).sqrt()
            shifts.append(float(((value - honest[key]).abs() / scale).median()))
    return max(ratios), max(shifts)


@pytest.mark.parametrize(
    "attack",
    [
        "bn_variance_x9",
        "bn_variance_zero",
        "bn_mean_8_sigma",
        "bn_variance_x3.9",
        "bn_variance_x0.26",
        "bn_mean_2.9_sigma",
    ],
)
def test_the_per_channel_median_keeps_one_boards_bn_statistics_from_moving_the_model(
    tmp_path: Path, attack: str
) -> None:
    """The default [run] bn_statistics = "median": one board of four sending BN statistics in range or far out
    (honest weights) is taken, and the model's statistics end where three honest boards and one more put them.
    Through the papers' mean, the in-range lies inside every bound (x3.9, x0.26, +2.9 sigma) move them."""
    run_simulation(tiny(rounds=2), tmp_path / "honest")
    run_simulation(tiny(rounds=2), tmp_path / "attacked", tamper=ATTACKS[attack].tamper)
    records = [
        json.loads(line) for line in (tmp_path / "attacked" / "metrics.jsonl").read_text().splitlines()
    ]
    assert all(r["aggregated"] and r["accepted"] == 4 for r in records)
    honest = final_weights(tmp_path / "honest")
    ratio, shift = _statistics_moved(final_weights(tmp_path / "attacked"), honest)
    assert ratio < 1.3 and shift < 0.5, (ratio, shift)
    if attack in ("bn_variance_x3.9", "bn_variance_x0.26", "bn_mean_2.9_sigma"):
        run_simulation(tiny(rounds=2, bn_statistics="mean"), tmp_path / "mean", tamper=ATTACKS[attack].tamper)
        ratio, shift = _statistics_moved(final_weights(tmp_path / "mean"), honest)
        assert ratio > 1.3 or shift > 0.5, (ratio, shift)


@pytest.mark.parametrize("attack", ["huge_values", "inflated_bn_variance", "sign_flipped"])
def test_with_quorum_one_a_refused_board_does_not_cost_the_round(tmp_path: Path, attack: str) -> None:
    """The quorum counts results that arrived valid: one refused update (an attacker's, or an honest outlier
    the direction screen refuses) leaves the round to the others instead of abandoning it."""
    direction = {"min_update_cosine": 0.0} if attack == "sign_flipped" else {}  # opt-in (issue 29)
    run_simulation(tiny(quorum=1.0, rounds=3, **direction), tmp_path, tamper=ATTACKS[attack].tamper)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    refused = {"sign_flipped": "rejected_update_direction"}.get(attack, "rejected_update_norm")
    assert all(r["aggregated"] and r["accepted"] == 4 - r["counters"].get(refused, 0) for r in records)
    assert sum(r["counters"].get(refused, 0) for r in records) >= 1
    assert not any(r["counters"].get("rounds_below_quorum") for r in records)


@pytest.mark.parametrize("method", ["heterofl", "nefl-wd", "depthfl"])
@pytest.mark.parametrize("rule", ["trimmed_mean", "median"])
def test_robust_rules_aggregate_every_nested_strategy(tmp_path: Path, method: str, rule: str) -> None:
    run_simulation(
        tiny(method, aggregation=rule, rounds=1, eval_every=1),
        tmp_path / rule,
        tamper=ATTACKS["sign_flipped"].tamper,
    )
    weights = final_weights(tmp_path / rule)
    assert all(bool(torch.isfinite(v).all()) for v in weights.values() if v.is_floating_point())


@pytest.mark.parametrize(
    "method, arch",
    [("fedavg", "tinycnn"), ("heterofl", "tinycnn"), ("nefl-wd", "resnet20"), ("depthfl", "resnet20")],
)
def test_honest_non_iid_boards_are_never_refused(tmp_path: Path, method: str, arch: str) -> None:
    """Dirichlet(0.1) digits: boards' updates differ a lot, yet no honest one is refused on norm or direction."""
    cfg = config_from_dict(
        {
            "run": {"rounds": 3, "seed": 1, "workers": 1, "eval_every": 3},
            "data": {
                "dataset": "digits",
                "partition": "dirichlet",
                "alpha": 0.1,
                "clients": 8,
                "limit_train": 800,
            },
            "model": {"arch": arch},
            "method": {"name": method},
            "train": {"fraction": 1.0, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
        }
    )
    run_simulation(cfg, tmp_path / method)
    records = [json.loads(line) for line in (tmp_path / method / "metrics.jsonl").read_text().splitlines()]
    refused = {k: v for r in records for k, v in r["counters"].items() if k.startswith("rejected")}
    assert not refused, refused
    assert all(r["aggregated"] for r in records)


def _preset_partitions() -> list[tuple[str, dict]]:
    """Each reproduction preset's small-scale partition: scheme, its options, clients and share a round."""
    import tomllib

    found = []
    for path in sorted((Path(__file__).resolve().parents[2] / "examples" / "reproduce").glob("*.toml")):
        small = tomllib.loads(path.read_text())["scales"]["small"]
        data = {k: v for k, v in small["data"].items() if k in ("partition", "alpha", "clients")}
        statistics = small["run"].get("bn_statistics", "median")
        found.append(
            (path.stem, {**data, "fraction": small["train"]["fraction"], "bn_statistics": statistics})
        )
    return found


@pytest.mark.parametrize("preset, partition", _preset_partitions(), ids=[p for p, _ in _preset_partitions()])
def test_no_screen_or_bound_acts_on_honest_fedavg_boards_of_any_presets_partition(
    tmp_path: Path, preset: str, partition: dict
) -> None:
    """Issue 29: the direction screen refused an honest FedAvg board of a Dirichlet(0.5) reproduction. With the
    defaults (direction screen off, norm and BN screens, weight bounds) and the preset's BN statistics rule,
    nothing acts on honest boards of any preset's partition (its scheme, alpha, clients and share a round, on
    digits with tinycnn)."""
    fraction, statistics = partition.pop("fraction"), partition.pop("bn_statistics")
    cfg = config_from_dict(
        {
            "run": {
                "rounds": 3,
                "seed": 0,
                "workers": 1,
                "eval_every": 0,
                "checkpoint_every": 0,
                "bn_statistics": statistics,  # the presets average them as the papers do: screened
            },
            "data": {"dataset": "digits", **partition},
            "model": {"arch": "tinycnn"},
            "method": {"name": "fedavg"},
            "train": {"fraction": fraction, "local_epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.9},
        }
    )
    run_simulation(cfg, tmp_path / preset)
    records = [json.loads(line) for line in (tmp_path / preset / "metrics.jsonl").read_text().splitlines()]
    acted = {
        k: v
        for r in records
        for k, v in r["counters"].items()
        if v and k.startswith(("rejected_", "clipped", "bounded_", "rolled_back"))
    }
    assert acted == {} and all(r["aggregated"] for r in records), acted
