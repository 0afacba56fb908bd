"""`nestling reproduce`: presets resolve and validate, claims are judged against the seed spread, runs resume."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import pytest
import torch

from nestling.cli import main
from nestling.errors import ConfigError
from nestling.server.checkpoint import latest_checkpoint, load_checkpoint
from nestling.server.strategies import STRATEGIES
from nestling.simulator.reproduce import (
    PRESET_DIR,
    Claim,
    RunResult,
    judge,
    known_comparisons,
    load_comparison,
    metric_reader,
    read_run,
    refused_counts,
    summarise_runs,
)
from nestling.simulator.reproduce_cli import reproduce, run_state
from nestling.simulator.reproduce_report import as_json, markdown, refused_cell
from nestling.simulator.run import run_simulation
from tests.simulator.reproduce_helpers import preset_strategy

TINY = """
name = "tiny"
title = "FedAvg vs HeteroFL on digits"
source = "a test"
metrics = ["worst", "avg", "full", "level-1"]
claims = ["fedavg > heterofl on worst", "heterofl > fedavg on full"]

[[methods]]
label = "fedavg"
method = "fedavg"
paper = { worst = 90.0 }

[[methods]]
label = "heterofl"
method = "heterofl"
options = { rates = [1.0, 0.5] }

[scales.small]
note = "two rounds"
run = { rounds = 3, eval_every = 1, workers = 1 }
data = { dataset = "digits", partition = "iid", clients = 4, limit_train = 160, limit_test = 60 }
model = { arch = "tinycnn" }
train = { fraction = 0.5, local_steps = 2, batch_size = 16 }
"""


@pytest.fixture
def tiny_preset(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return path


def _shipped_presets() -> list[str]:
    return [*known_comparisons(), *sorted(str(p) for p in (PRESET_DIR / "ablations").glob("*.toml"))]


# Building these strategies runs ScaleFL's memory-level search over ResNet-56/110 with derived costs (13-31 CPU
# seconds each): every preset's options are still checked in CI by the test below this one.
_SLOW_TO_BUILD = {("scalefl", "paper"), ("scalefl-r56.toml", "small"), ("scalefl-kd.toml", "paper")}


@pytest.mark.parametrize(
    ("name", "scale"),
    [
        pytest.param(name, scale, marks=[pytest.mark.slow] if (name, scale) in _SLOW_TO_BUILD else [])
        for name in [*("nefl", "fedepth", "scalefl", "dynamicfl", "fedtrans"), "ablations"]
        for scale in ("small", "paper")
    ]
    + [
        pytest.param(name, scale, marks=pytest.mark.slow)
        for name, scale in sorted(_SLOW_TO_BUILD)
        if name.endswith(".toml")
    ],
)
def test_every_shipped_preset_builds_each_method_at_each_scale(name: str, scale: str) -> None:
    """A typo in a preset's options must fail here, not after hours of the other methods' training; the
    ablations docs/reproductions.md cites (examples/reproduce/ablations/) are checked the same way."""
    assert {"nefl", "fedepth", "scalefl", "dynamicfl", "fedtrans"} <= set(known_comparisons())
    ablations = [p for p in _shipped_presets() if Path(p).parent.name == "ablations"]
    if name == "ablations":
        names = [p for p in ablations if (Path(p).name, scale) not in _SLOW_TO_BUILD]
        assert len(names) >= 1
    elif name.endswith(".toml"):
        names = [p for p in ablations if Path(p).name == name]
        assert names, f"no ablation preset {name}"
    else:
        names = [name]
    for preset in names:
        comparison = load_comparison(preset, scale)
        assert comparison.claims, f"{preset} claims nothing"
        for entry in comparison.entries:
            cfg = comparison.config(entry, seed=3)
            assert cfg.run.seed == 3 and cfg.method.name == entry.method
            strategy = preset_strategy(comparison, entry, seed=3)
            assert strategy.eval_targets(), f"{preset}/{entry.label} has nothing to evaluate"


def test_every_shipped_presets_method_options_are_a_valid_record() -> None:
    """Every preset at every scale, the slow-to-build ones included: its options make the method's typed record."""
    presets = _shipped_presets()
    assert len([p for p in presets if Path(p).parent.name == "ablations"]) >= 3
    checked = 0
    for preset in presets:
        for scale in ("small", "paper"):
            comparison = load_comparison(preset, scale)
            for entry in comparison.entries:
                cfg = comparison.config(entry, seed=3)
                STRATEGIES[entry.method].options_type.from_table(entry.method, dict(cfg.method.options))
                checked += 1
    assert checked >= 20


def test_methods_of_one_seed_share_everything_but_the_method() -> None:
    comparison = load_comparison("nefl", "small")
    configs = [comparison.config(entry, seed=1).to_dict() for entry in comparison.entries]
    for cfg in configs:
        cfg.pop("method")
    assert all(cfg == configs[0] for cfg in configs)


def test_bad_presets_are_refused_with_the_reason(tmp_path: Path) -> None:
    cases = {
        "claim": ('claims = ["fedavg beats heterofl"]', "must read 'A > B on METRIC'"),
        "label": ('claims = ["fedavg > fjord on worst"]', "names 'fjord'"),
        "metric": ('claims = ["fedavg > heterofl on best"]', "uses metric 'best'"),
    }
    for name, (line, reason) in cases.items():
        path = tmp_path / f"{name}.toml"
        path.write_text(
            TINY.replace('claims = ["fedavg > heterofl on worst", "heterofl > fedavg on full"]', line)
        )
        with pytest.raises(ConfigError, match=reason):
            load_comparison(str(path), "small")
    with pytest.raises(ConfigError, match="no scale 'paper'"):
        load_comparison(str(tmp_path / "claim.toml").replace("claim", "label"), "paper")
    with pytest.raises(ConfigError, match="no reproduction named 'nope'"):
        load_comparison("nope", "small")


def test_metrics_read_submodels_by_size() -> None:
    subs = [
        {"accuracy": 0.5, "parameters": 100},
        {"accuracy": 0.7, "parameters": 10},
        {"accuracy": 0.6, "parameters": 50},
    ]
    assert (
        metric_reader("worst")(subs) == 0.7
    )  # METHODS' worst is the smallest submodel, not the lowest score
    assert metric_reader("avg")(subs) == pytest.approx(0.6)
    assert metric_reader("full")(subs) == 0.5
    assert metric_reader("level-1")(subs) == 0.7
    assert metric_reader("level-2")(subs) == 0.6
    with pytest.raises(ConfigError, match="level 4 of 3"):
        metric_reader("level-4")(subs)
    with pytest.raises(ConfigError, match="unknown metric"):
        metric_reader("level-0")


def _runs(finals: dict[str, dict[int, dict[str, float]]]) -> list[RunResult]:
    """Constructed finished runs: label -> seed -> metric -> final value."""
    return [
        RunResult(label, seed, dict(values), {m: [(19, v)] for m, v in values.items()}, 60.0, 20)
        for label, by_seed in finals.items()
        for seed, values in by_seed.items()
    ]


def test_refused_results_are_summed_by_reason_and_shown_in_the_table() -> None:
    records = [
        {"round": 0, "counters": {"rejected_update_cohort": 1, "accepted": 9}},
        {"round": 1, "counters": {}},
        {"round": 2, "counters": {"rejected_update_cohort": 2, "rejected_update_norm": 1, "stale": 4}},
    ]
    assert refused_counts(records) == {"rejected_update_cohort": 3, "rejected_update_norm": 1}
    runs = _runs({"fedavg": {0: {"worst": 50.0}, 1: {"worst": 51.0}}})
    assert refused_cell(runs) == "0" and refused_cell([]) == "–"
    runs[1] = dataclasses.replace(runs[1], refused=refused_counts(records))
    assert refused_cell(runs) == "4 (rejected_update_cohort 3, rejected_update_norm 1)"


def test_the_issues_example_is_held_but_not_clear_because_one_seed_disagrees() -> None:
    """Issue 29: nefl-wd > heterofl on worst was +2.21 on the mean (spread 2.00, unpaired) with seed 0 at -0.11."""
    comparison = load_comparison("nefl", "small")
    runs = _runs(
        {
            "nefl-wd": {0: {"worst": 50.00, "avg": 60.0}, 1: {"worst": 54.53, "avg": 61.0}},
            "heterofl": {0: {"worst": 50.11, "avg": 55.0}, 1: {"worst": 50.00, "avg": 56.0}},
            "fjord": {0: {"worst": 40.0, "avg": 50.0}, 1: {"worst": 41.0, "avg": 50.0}},
        }
    )
    verdicts = {str(v.claim): v for v in judge(comparison, runs)}
    worst = verdicts["nefl-wd > heterofl on worst"]
    assert worst.margins == pytest.approx({0: -0.11, 1: 4.53})
    assert worst.margin == pytest.approx(2.21) and worst.held
    assert not worst.every_seed and not worst.clear
    avg = verdicts["nefl-wd > heterofl on avg"]  # +5 on both seeds: no spread to exceed... and 0 < 5
    assert avg.every_seed and avg.clear and avg.spread == 0.0
    assert verdicts["nefl-wd > fjord on worst"].clear


def test_a_claim_ahead_on_every_seed_is_clear_only_beyond_the_paired_spread() -> None:
    comparison = load_comparison("nefl", "small")
    base = {seed: {"worst": 50.0, "avg": 60.0} for seed in (0, 1, 2)}
    runs = _runs(
        {
            # worst: +0.2, +6, +0.1 -> ahead on every seed, mean 2.1 < std 3.38: held, not clear
            "nefl-wd": {
                0: {"worst": 50.2, "avg": 62.0},
                1: {"worst": 56.0, "avg": 62.5},
                2: {"worst": 50.1, "avg": 61.8},
            },
            "heterofl": base,
            "fjord": base,
        }
    )
    verdicts = {str(v.claim): v for v in judge(comparison, runs)}
    worst = verdicts["nefl-wd > heterofl on worst"]
    assert worst.every_seed and worst.held and not worst.clear
    assert worst.spread == pytest.approx(statistics.stdev([0.2, 6.0, 0.1]))
    assert verdicts["nefl-wd > heterofl on avg"].clear  # +2.0, +2.5, +1.8: std 0.36


def test_a_method_missing_a_seed_is_compared_only_on_the_seeds_both_have() -> None:
    """Averaging heterofl over seeds 0-2 against nefl-wd's seeds 0-1 would mix partitions; pairing cannot."""
    comparison = load_comparison("nefl", "small")
    runs = _runs(
        {
            "nefl-wd": {0: {"worst": 51.0, "avg": 60.0}, 1: {"worst": 52.0, "avg": 60.0}},
            "heterofl": {
                0: {"worst": 50.0, "avg": 59.0},
                1: {"worst": 51.5, "avg": 59.0},
                2: {"worst": 30.0, "avg": 40.0},
            },
            "fjord": {2: {"worst": 45.0, "avg": 55.0}},
        }
    )
    verdicts = {str(v.claim): v for v in judge(comparison, runs)}
    paired = verdicts["nefl-wd > heterofl on worst"]
    assert paired.seeds == 2 and set(paired.margins) == {0, 1}
    assert paired.margin == pytest.approx(0.75)  # seed 2's 30.0 is not in it (unpaired it would read +11.3)
    none = verdicts["nefl-wd > fjord on worst"]
    assert none.seeds == 0 and not none.held and not none.clear
    text = markdown(comparison, summarise_runs(comparison, runs), judge(comparison, runs), runs, "cmd")
    assert "– (no common seed)" in text and "| 0,1,2 |" in text


def test_a_single_seed_margin_is_never_clear_and_its_table_says_why() -> None:
    """With one seed the spread is 0, and any positive margin would otherwise pass as beyond it."""
    comparison = load_comparison("nefl", "small")
    runs = _runs(
        {
            "nefl-wd": {0: {"worst": 62.0, "avg": 75.0}},
            "fjord": {0: {"worst": 59.0, "avg": 70.5}, 1: {"worst": 59.4, "avg": 70.7}},
            "heterofl": {0: {"worst": 50.0, "avg": 60.0}},
        }
    )
    verdicts = judge(comparison, runs)
    assert all(v.held and not v.clear and v.seeds == 1 for v in verdicts)
    text = markdown(comparison, summarise_runs(comparison, runs), verdicts, runs, "cmd")
    assert text.count("– (one seed)") == len(verdicts)
    assert Claim.parse(" a>b on  worst ") == Claim("a", "b", "worst")


def test_reproduce_runs_judges_and_skips_finished_runs(tiny_preset: Path, tmp_path: Path) -> None:
    comparison = load_comparison(str(tiny_preset), "small")
    out = tmp_path / "out"
    runs, files, last = reproduce(comparison, [0, 1], out, quiet=True, command="test")
    assert len(runs) == 4 and all(r.rounds == 3 for r in runs)
    assert last.startswith("ordering_held=") and "/2 ordering_clear=" in last and "fedavg_worst=" in last
    for path in files.values():
        assert path.is_file() and path.stat().st_size > 0
    report = json.loads(files["json"].read_text())
    assert report["methods"]["fedavg"]["measured"]["worst"]["seeds"] == 2
    assert [r["seed"] for r in report["methods"]["heterofl"]["runs"]] == [0, 1]
    table = summarise_runs(comparison, runs)
    assert table["fedavg"]["worst"].mean == pytest.approx(sum(r.final["worst"] for r in runs[::2]) / 2)
    markdown = files["markdown"].read_text()
    assert "| fedavg |" in markdown and "90.00" in markdown and "fedavg > heterofl on worst" in markdown
    # every delivered result's compute is recorded: 2 local steps each, HeteroFL's half width costs less
    assert all(r.compute["steps_min"] == r.compute["steps_max"] == 2 for r in runs)
    assert runs[0].compute["macs_min"] == runs[0].compute["macs_max"] > 0  # fedavg: one model
    assert runs[1].compute["macs_min"] < runs[1].compute["macs_max"]  # heterofl: rates 1 and 1/2
    assert "| 0,1 | 2 |" in markdown and "steps / client-round" in markdown
    assert report["claims"][0]["margins"].keys() == {"0", "1"}
    # no attacker: nothing refused, and the table and JSON say so per method and run
    assert all(r.refused == {} for r in runs) and report["methods"]["fedavg"]["runs"][0]["refused"] == {}
    assert "| refused | wall min |" in markdown
    # seeds differ (their partitions and initial weights do), methods of one seed share the test set
    assert runs[0].final != runs[2].final
    stamp = (out / "seed-0" / "fedavg" / "summary.json").stat().st_mtime_ns
    reproduce(comparison, [0, 1], out, quiet=True)
    assert (out / "seed-0" / "fedavg" / "summary.json").stat().st_mtime_ns == stamp


class _Stop(Exception):
    pass


def test_an_interrupted_run_resumes_to_the_weights_of_an_uninterrupted_one(
    tiny_preset: Path, tmp_path: Path
) -> None:
    comparison = load_comparison(str(tiny_preset), "small")
    entry = comparison.entry("heterofl")
    cfg = comparison.config(entry, seed=0)

    def stop_after_first(record: object) -> None:
        raise _Stop

    interrupted = tmp_path / "out" / "seed-0" / "heterofl"
    with pytest.raises(_Stop):
        run_simulation(cfg, interrupted, on_round=stop_after_first)
    assert run_state(interrupted, cfg) == "partial"
    reproduce(comparison, [0], tmp_path / "out", only=["heterofl"], quiet=True)
    assert run_state(interrupted, cfg) == "done"
    straight = tmp_path / "straight"
    run_simulation(cfg, straight)
    resumed_state, _ = load_checkpoint(latest_checkpoint(interrupted / "checkpoints"))
    straight_state, _ = load_checkpoint(latest_checkpoint(straight / "checkpoints"))
    assert resumed_state.keys() == straight_state.keys()
    assert all(torch.equal(resumed_state[k], straight_state[k]) for k in straight_state)


def test_command_line_prints_the_ordering_line(
    tiny_preset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli"
    assert main(["reproduce", str(tiny_preset), "--seeds", "0", "--out", str(out), "--quiet"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("ordering_held=")
    assert main(["reproduce", str(tiny_preset), "--seeds", "0,0", "--out", str(out), "--quiet"]) == 2
    assert "--seeds must list distinct integers" in capsys.readouterr().err


def test_a_run_folder_made_with_another_configuration_is_refused_not_reused(
    tiny_preset: Path, tmp_path: Path
) -> None:
    comparison = load_comparison(str(tiny_preset), "small")
    out = tmp_path / "out"
    reproduce(comparison, [0], out, only=["fedavg"], quiet=True)
    run_dir = out / "seed-0" / "fedavg"
    edited = tiny_preset.read_text().replace("local_steps = 2", "local_steps = 3")
    assert edited != tiny_preset.read_text()
    tiny_preset.write_text(edited)
    changed = load_comparison(str(tiny_preset), "small")
    with pytest.raises(ConfigError, match=r"another configuration \(train\.local_steps: 2 -> 3\)"):
        reproduce(changed, [0], out, only=["fedavg"], quiet=True)
    # where the data lives and how many workers train do not change a run: those folders are still reused
    cfg = changed.config(changed.entry("fedavg"), seed=0)
    tiny_preset.write_text(edited.replace("local_steps = 3", "local_steps = 2"))
    same = load_comparison(str(tiny_preset), "small")
    moved = same.config(same.entry("fedavg"), seed=0, data_root=str(tmp_path / "elsewhere"))
    assert run_state(run_dir, moved) == "done" and cfg.train.local_steps == 3


def test_m_fedepth_distils_on_some_board_in_the_fedepth_comparison() -> None:
    """With fair budgets no board holds two full models; without mutual_depthwise m-FeDepth was FeDepth
    bit for bit (seen in a reproduction: identical losses every round)."""
    for scale in ("small", "paper"):
        comparison = load_comparison("fedepth", scale)
        strategy = preset_strategy(comparison, comparison.entry("m-fedepth"))
        strategy.setup()
        models = {ratio: strategy.paper_plan_for(ratio)[1] for ratio in strategy.ratios}
        assert max(models.values()) == 2, models


def test_a_folder_recorded_before_bn_statistics_existed_reads_as_the_mean_it_ran(tmp_path: Path) -> None:
    """Runs recorded before [run] bn_statistics averaged BN statistics: a config.toml without the setting is the
    papers' mean, which every preset keeps (their records stay theirs), and not the fleet's median."""
    from nestling.config_io import config_to_toml
    from nestling.simulator.reproduce_cli import config_changes

    comparison = load_comparison("scalefl", "small")
    cfg = comparison.config(comparison.entry("depthfl"), seed=1)
    assert cfg.run.bn_statistics == "mean"
    folder = tmp_path / "old"
    folder.mkdir()
    old = "\n".join(line for line in config_to_toml(cfg).splitlines() if not line.startswith("bn_statistics"))
    (folder / "config.toml").write_text(old)
    assert config_changes(folder, cfg) == []
    median = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, bn_statistics="median"))
    assert config_changes(folder, median) == ["run.bn_statistics: 'mean' -> 'median'"]


def test_what_the_boards_trained_is_read_by_the_method_and_printed_under_the_table(tmp_path: Path) -> None:
    """Issue 29: a DynamicFL record says what was trained; a method with nothing to add prints nothing."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        json.dumps({"round": 19, "submodels": [{"parameters": 10, "accuracy": 0.5}]}) + "\n"
    )
    structures = {"dev-0": {"stem.conv": ["kxk"]}, "dev-1": {"stem.conv": ["kxk"], "blocks.0.conv1": ["kxk"]}}
    report = {"dynamicfl": {"protocol": "paper", "classes": {"c2": {"boards": 2, "structures": structures}}}}
    (run / "summary.json").write_text(json.dumps({"wall_seconds": 60, "method_report": report}))
    trained = read_run("dynamicfl", 0, run, ("full",), "dynamicfl")
    assert trained.final == {"full": 50.0}
    assert trained.trained == "convs expanded in the final round's trained structure: c2 1.50 (2 boards)"
    assert read_run("fedavg", 0, run, ("full",), "fedavg").trained == ""
    assert read_run("x", 0, run, ("full",)).trained == ""

    comparison = load_comparison("dynamicfl", "small")
    runs = _runs({"dynamicfl": {0: {"full": 50.0}}, "fedavg": {0: {"full": 49.0}}})
    runs[0] = dataclasses.replace(runs[0], trained=trained.trained)
    table, verdicts = summarise_runs(comparison, runs), judge(comparison, runs)
    text = markdown(comparison, table, verdicts, runs, "cmd")
    assert f"What the boards trained:\n- dynamicfl, seed 0: {trained.trained}" in text
    assert "| dynamicfl-c1 | – | – | – | – | – | – | – |" in text  # no run: nothing claimed, not "0 refused"
    document = as_json(comparison, table, verdicts, runs)
    assert document["methods"]["dynamicfl"]["runs"][0]["trained"] == trained.trained
    assert document["methods"]["fedavg"]["runs"][0]["trained"] == ""
