"""benchmarks/precision_parity.py: fp32 and bf16 twins differ only in precision, the safety rule, and the run itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.precision_parity import MethodFigures, Outcome, config, outcome, parse_args
from benchmarks.vs_flower import ENGINES
from tests.benchmarks.quick_run import run_benchmark, run_script_help


def test_the_twins_of_a_method_differ_only_in_precision() -> None:
    a = parse_args(["--data-root", "data", "--rounds", "3"])
    for method in ("fedavg", "depthfl", "scalefl", "mfedepth", "fjord"):
        fp32, bf16 = (config(a, method, p, seed=1).to_dict() for p in ("fp32", "bf16"))
        assert (fp32["train"].pop("precision"), bf16["train"].pop("precision")) == ("fp32", "bf16")
        assert fp32 == bf16, method


def test_each_distillation_method_runs_with_its_distillation_switched_on() -> None:
    a = parse_args(["--data-root", "data", "--rounds", "7"])
    options = {m: config(a, m, "bf16", seed=0).method for m in ("depthfl", "scalefl", "mfedepth", "fjord")}
    assert options["depthfl"].name == "depthfl" and options["depthfl"].options["kd_ramp_rounds"] == 7
    assert options["scalefl"].options["kd_gamma"] > 0
    assert options["mfedepth"].name == "m-fedepth"
    assert options["fjord"].options["kd"] is True


def test_the_fast_path_bf16_run_uses_the_settings_of_vs_flowers_bf16_engine() -> None:
    a = parse_args(["--data-root", "data", "--fast-path"])
    fast = config(a, "fedavg", "bf16", seed=1)
    engine = ENGINES["nestling-bf16"]
    assert (fast.train.precision, fast.train.channels_last, fast.run.batching) == (
        engine.precision,
        engine.channels_last,
        engine.batching,
    )
    plain = config(a, "fedavg", "fp32", seed=1)
    assert (plain.train.precision, plain.train.channels_last, plain.run.batching) == ("fp32", False, "off")
    # The full mode's workload: issue 6's FedAvg ResNet-20 on CIFAR-10, 10 of 100 clients, batch 32.
    assert (plain.model.arch, plain.data.dataset, plain.data.clients, plain.train.fraction) == (
        "resnet20",
        "cifar10",
        100,
        0.1,
    )


def test_quick_defaults_yield_to_options_given_on_the_command_line() -> None:
    quick = parse_args(["--quick"])
    assert (quick.dataset, quick.rounds, quick.seeds) == ("digits", 2, "0")
    assert parse_args(["--quick", "--rounds", "1"]).rounds == 1


def result(accuracy: float, *, non_finite: int = 0, rolled_back: int = 0, refused: int = 0) -> Outcome:
    return Outcome(accuracy, 10.0, non_finite, rolled_back, refused)


def test_a_runs_trouble_is_read_from_its_metrics_but_honest_direction_refusals_do_not_count(
    tmp_path: Path,
) -> None:
    rounds = [
        {"round": 0, "train_loss": 2.1, "counters": {"rejected_update_direction": 2}},
        {"round": 1, "train_loss": float("nan"), "counters": {"rejected_update_norm": 1}, "rolled_back": 1},
        {"round": 2, "train_loss": 1.5, "counters": {"rejected_invalid": 1, "dropouts": 3}},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rounds) + "\n")
    summary = {
        "avg_accuracy": 0.5,
        "train_seconds": 12.0,
        "submodels": [{"loss": 1.2}, {"loss": float("inf")}],
    }
    assert outcome(summary, tmp_path) == Outcome(
        accuracy=50.0, train_seconds=12.0, non_finite_losses=2, rolled_back=1, refused=2
    )


def test_the_safety_rule_allows_a_drop_within_the_tolerance_or_the_fp32_seed_range() -> None:
    within = MethodFigures([result(50.0), result(52.0)], [result(49.5), result(51.0)])
    assert within.drop == pytest.approx(0.75) and within.safe(tolerance=1.0)
    noisy = MethodFigures([result(50.0), result(53.0)], [result(48.0), result(51.0)])
    assert noisy.drop == pytest.approx(2.0) and noisy.allowed_drop(1.0) == 3.0 and noisy.safe(1.0)
    worse = MethodFigures([result(50.0)], [result(48.5)])
    assert not worse.safe(tolerance=1.0) and worse.safe(tolerance=2.0)
    better = MethodFigures([result(50.0)], [result(55.0)])  # bf16 ahead is no harm
    assert better.safe(tolerance=1.0)


@pytest.mark.parametrize(
    ("bf16", "trouble"),
    [
        (result(50.0, non_finite=1), "non-finite training loss"),
        (result(50.0, rolled_back=1), "rolled-back round"),
        (result(50.0, refused=2), "more updates refused than fp32"),
    ],
)
def test_divergence_signs_make_bf16_unsafe_whatever_the_accuracy(bf16: Outcome, trouble: str) -> None:
    figures = MethodFigures([result(50.0, refused=1)], [bf16])
    assert figures.trouble() == [trouble] and not figures.safe(tolerance=100.0)


@pytest.mark.slow  # 20 s of training; the verdict rule is tested in-process above, --help runs in CI
def test_one_method_for_one_round_prints_the_verdict_line_last() -> None:
    lines = run_benchmark("precision_parity", "--quick", "--methods", "fjord", "--rounds", "1", timeout=900)
    assert any(line.startswith("rule: safe = ") for line in lines)
    figures = dict(item.split("=", 1) for item in lines[-1].split())
    assert set(figures) == {"acc_drop_fjord", "time_ratio_fjord", "bf16_safe"}
    assert float(figures["time_ratio_fjord"]) > 0 and figures["bf16_safe"] in ("fjord", "none")


@pytest.mark.slow
def test_quick_mode_compares_every_method_and_prints_the_verdict_line() -> None:
    last = run_benchmark("precision_parity", "--quick", timeout=1800)[-1]
    figures = dict(item.split("=", 1) for item in last.split())
    methods = ("fedavg", "depthfl", "scalefl", "mfedepth", "fjord")
    assert set(figures) == {f"acc_drop_{m}" for m in methods} | {f"time_ratio_{m}" for m in methods} | {
        "bf16_safe"
    }
    assert set(figures["bf16_safe"].split(",")) <= {*methods, "none"}


def test_help_runs_as_a_script() -> None:
    assert "--quick" in run_script_help("precision_parity")
