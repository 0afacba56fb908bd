"""FedTrans as a strategy (METHODS §4, issue 13): a family that grows in a short real run (UCI digits, tinycnn),
reports and exports every model, resumes across a transformation exactly, respects each board's capacity and
never feeds the seed model from a larger one."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from nestling.checkpoint_io import latest_checkpoint, load_checkpoint
from nestling.config import config_from_dict
from nestling.edge.procedures import DeviceStore
from nestling.edge.trainer import run_task
from nestling.errors import ConfigError, SpecError
from nestling.export.source import open_checkpoint, select_target
from nestling.messages import Task
from nestling.methods.fedtrans import fedavg, layout_of
from nestling.profiler.catalogue import BOARDS
from nestling.server.strategies import DeviceInfo, StrategyContext, create_strategy
from nestling.server.strategies.fedtrans import FedTrans
from nestling.server.strategies.fedtrans_capacity import Capacity, capacity_of
from nestling.simulator.fleetdata import device_id, load_fleet_data
from tests.methods.fedtrans.growth_helpers import TINY_VIT, family_without_layout

torch.set_num_threads(1)

# γ = δ = 1 and a β no loss slope reaches: the newest model grows as soon as it has two rounds of losses.
GROW_FAST = {"gamma": 1, "delta": 1, "beta": 10.0, "capacities": [1, 8]}


class Interrupted(Exception):
    pass


def sim_config(rounds: int, model: dict[str, Any] | None = None, **options: Any) -> Any:
    return config_from_dict(
        {
            "run": {"rounds": rounds, "seed": 1, "workers": 1, "eval_every": 1, "checkpoint_every": 1},
            "data": {"dataset": "digits", "clients": 6, "limit_train": 600, "limit_test": 200},
            "model": model or {"arch": "tinycnn"},
            "method": {"name": "fedtrans", **GROW_FAST, **options},
            "train": {
                "fraction": 1.0,
                "local_steps": 5,
                "batch_size": 10,
                "lr": 0.05,
                "schedule": "constant",
            },
        }
    )


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_short_run_grows_the_family_reports_every_model_and_exports_each_by_id(tmp_path: Path) -> None:
    from nestling.simulator.run import run_simulation

    summary = run_simulation(sim_config(5), tmp_path)
    rows = records(tmp_path)
    births = [r["method"]["fedtrans"]["born"] for r in rows if "born" in r["method"]["fedtrans"]]
    assert births and births[0]["born_round"] == 1  # γ + δ = 2 losses of m0: the first round DoC exists
    assert [b["id"] for b in births] == [f"m{k}" for k in range(1, len(births) + 1)]
    assert [b["parent"] for b in births] == [f"m{k}" for k in range(len(births))]  # parent = newest model
    family = summary["method_report"]["fedtrans"]["models"]
    assert len(family) == len(births) + 1
    assert all(later["macs"] > earlier["macs"] for earlier, later in itertools.pairwise(family))
    assert family[0]["parent"] is None and family[0]["uploads"] > 0
    assert sum(r["method"]["fedtrans"]["client_macs"] for r in rows) == pytest.approx(
        summary["method_report"]["fedtrans"]["client_macs_total"]
    )
    assert [s["name"] for s in rows[-1]["submodels"]] == [m["id"] for m in family]  # per-model accuracy
    assert all(0.0 <= s["accuracy"] <= 1.0 for s in rows[-1]["submodels"])
    assert set(summary["method_report"]["fedtrans"]["deployed"].values()) <= {m["id"] for m in family}
    # METHODS §4.a.6: each board scored on its highest-utility compatible model, mean and IQR over boards
    boards = summary["boards"]
    assert {d: b["submodel"] for d, b in boards["boards"].items()} == summary["method_report"]["fedtrans"][
        "deployed"
    ]
    scores = {s["name"]: s["accuracy"] for s in rows[-1]["submodels"]}
    assert boards["mean"] == pytest.approx(
        sum(scores[b["submodel"]] for b in boards["boards"].values()) / len(boards["boards"])
    )
    assert boards["iqr"] == pytest.approx(boards["q3"] - boards["q1"]) and boards["unevaluated"] == 0
    assert summary["plots"] == ["growth.png"] and (tmp_path / "growth.png").stat().st_size > 10_000

    source = open_checkpoint(tmp_path)
    newest = select_target(source, submodel=family[-1]["id"])
    layout = layout_of(newest.spec.model)
    assert [list(layout.stage_blocks), list(layout.block_hidden)] == [
        family[-1]["stage_blocks"],
        family[-1]["block_hidden"],
    ]
    from nestling.models.zoo import build

    net = build(newest.spec, init=False)
    net.load_state_dict(newest.state, strict=True)  # the exported weights build into the grown architecture


def test_resume_across_a_transformation_ends_with_the_uninterrupted_weights(tmp_path: Path) -> None:
    from nestling.simulator.run import run_simulation

    cfg = sim_config(5, capacities=[8])  # every board may draw every model: the newest trains often
    run_simulation(cfg, tmp_path / "straight")

    def crash_after_round_2(record: Any) -> None:
        if record.round == 2:
            raise Interrupted

    with pytest.raises(Interrupted):
        run_simulation(cfg, tmp_path / "resumed", on_round=crash_after_round_2)
    _, crashed_manifest = load_checkpoint(latest_checkpoint(tmp_path / "resumed" / "checkpoints"))
    run_simulation(cfg, tmp_path / "resumed", resume=True)
    straight, manifest = load_checkpoint(latest_checkpoint(tmp_path / "straight" / "checkpoints"))
    resumed, resumed_manifest = load_checkpoint(latest_checkpoint(tmp_path / "resumed" / "checkpoints"))
    models_at_crash = len(crashed_manifest["strategy"]["models"])
    assert (
        models_at_crash >= 2 and len(manifest["strategy"]["models"]) > models_at_crash
    )  # births on both sides
    assert set(straight) == set(resumed) and all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert resumed_manifest["strategy"] == manifest["strategy"]  # lineage, utilities, losses, capacities
    assert [r["round"] for r in records(tmp_path / "resumed")] == [0, 1, 2, 3, 4]


def test_a_vit_family_grows_encoder_blocks_trains_them_resumes_and_exports(tmp_path: Path) -> None:
    """A tiny ViT (2 encoder blocks, dim 16, 17 tokens): boards train grown ViTs, a run interrupted after the first
    birth ends as the uninterrupted one, and the newest grown ViT exports from the checkpoint with parity."""
    from nestling.export.options import ExportOptions
    from nestling.export.pipeline import export_submodel
    from nestling.simulator.run import run_simulation

    cfg = sim_config(4, {"arch": "vit", "extra": dict(TINY_VIT)}, capacities=[8])
    summary = run_simulation(cfg, tmp_path / "straight")
    family = summary["method_report"]["fedtrans"]["models"]
    assert [m["parent"] for m in family] == [None, *(f"m{k}" for k in range(len(family) - 1))]
    assert len(family) >= 3 and family[-1]["stage_blocks"] == [3]  # one widen, then one deepen
    assert family[1]["applied"][0][0] == "widen" and max(family[1]["block_hidden"]) == 2 * TINY_VIT["mlp_dim"]
    assert family[1]["uploads"] > 0  # boards built, trained and returned a grown ViT
    assert all(later["macs"] > earlier["macs"] for earlier, later in itertools.pairwise(family))

    def crash_after_round_1(record: Any) -> None:
        if record.round == 1:
            raise Interrupted

    with pytest.raises(Interrupted):
        run_simulation(cfg, tmp_path / "resumed", on_round=crash_after_round_1)
    _, crashed_manifest = load_checkpoint(latest_checkpoint(tmp_path / "resumed" / "checkpoints"))
    assert len(crashed_manifest["strategy"]["models"]) == 2  # the checkpoint holds a grown ViT
    run_simulation(cfg, tmp_path / "resumed", resume=True)
    straight, manifest = load_checkpoint(latest_checkpoint(tmp_path / "straight" / "checkpoints"))
    resumed, resumed_manifest = load_checkpoint(latest_checkpoint(tmp_path / "resumed" / "checkpoints"))
    assert set(straight) == set(resumed) and all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert resumed_manifest["strategy"] == manifest["strategy"]

    checkpoint = latest_checkpoint(tmp_path / "resumed" / "checkpoints")
    bundle = export_submodel(
        checkpoint, tmp_path / "bundle", submodel=family[-1]["id"], options=ExportOptions(benchmark=False)
    )
    assert bundle["source"]["submodel"] == family[-1]["id"]
    assert bundle["spec"]["model"]["extra"]["layout"] == {
        "stage_blocks": family[-1]["stage_blocks"],
        "block_hidden": family[-1]["block_hidden"],
    }
    assert bundle["parity"]  # export_target raises when the ONNX graph misses the PyTorch model's tolerance
    assert (tmp_path / "bundle" / "model.onnx").stat().st_size > 0


def digits_clients(count: int) -> Any:
    return load_fleet_data(
        dataset="digits",
        root=None,
        seed=0,
        partition="iid",
        clients=count,
        partition_options={},
        limit_train=600,
        limit_test=100,
    )


def test_boards_train_only_what_fits_and_the_seed_model_learns_only_from_its_own_boards() -> None:
    fleet = digits_clients(6)
    ctx = StrategyContext(
        arch="tinycnn",
        num_classes=10,
        in_channels=1,
        image_size=16,
        num_clients=6,
        total_rounds=6,
        seed=2,
        local={"local_steps": 4, "batch_size": 10, "momentum": 0.0},
        options=GROW_FAST,
    )
    strategy = create_strategy("fedtrans", ctx)
    assert isinstance(strategy, FedTrans)
    devices = [DeviceInfo(device_id(i), i, len(fleet.client(device_id(i)))) for i in range(6)]
    trained_by_strong = set()
    for round_index in range(6):
        tasks = strategy.assign(round_index, devices)
        accepted = []
        for task in tasks.values():
            k = strategy.model_of(task)
            assert strategy.members[k].macs <= strategy.capacities[task.device_id].macs
            if k > 0:
                trained_by_strong.add(task.device_id)
            result = run_task(task, fleet.client(task.device_id), DeviceStore())
            strategy.validate(task, result)
            accepted.append((task, result))
        seed_uploads = [(r.weights, r.num_samples) for t, r in accepted if t.model_id == "m0"]
        strategy.aggregate(round_index, accepted)
        if seed_uploads:  # Eq. 5 with l2s off: m0 is exactly the FedAvg of its own uploads
            expected = fedavg([w for w, _ in seed_uploads], [float(n) for _, n in seed_uploads])
            for key, value in expected.items():
                if value.is_floating_point():
                    assert torch.allclose(strategy.members[0].state[key], value, atol=1e-6), key
    assert len(strategy.members) >= 3
    weak = {d.device_id for d in devices if strategy.capacities[d.device_id].macs < strategy.members[1].macs}
    assert weak and not weak & trained_by_strong  # tier-1 boards only ever trained the seed model
    assert trained_by_strong  # and the strong tier did train grown models
    assert all(len(row) == len(strategy.members) for row in strategy.utilities.values())


def test_with_l2s_the_seed_model_also_learns_from_the_grown_models() -> None:
    """[method] l2s = true: once a grown model has uploads, m0 is no longer the plain FedAvg of its own boards."""
    fleet = digits_clients(4)
    ctx = StrategyContext(
        arch="tinycnn",
        num_classes=10,
        in_channels=1,
        image_size=16,
        num_clients=4,
        total_rounds=4,
        seed=2,
        local={"local_steps": 2, "batch_size": 10, "momentum": 0.0},
        options={**GROW_FAST, "l2s": True},
    )
    strategy = create_strategy("fedtrans", ctx)
    assert isinstance(strategy, FedTrans) and strategy.l2s
    devices = [DeviceInfo(device_id(i), i, len(fleet.client(device_id(i)))) for i in range(4)]
    mixed_rounds = 0
    for round_index in range(4):
        tasks = strategy.assign(round_index, devices)
        accepted = [(t, run_task(t, fleet.client(t.device_id), DeviceStore())) for t in tasks.values()]
        seed_uploads = [(r.weights, r.num_samples) for t, r in accepted if t.model_id == "m0"]
        larger_trained = any(t.model_id != "m0" for t, _ in accepted)
        strategy.aggregate(round_index, accepted)
        if seed_uploads:
            expected = fedavg([w for w, _ in seed_uploads], [float(n) for _, n in seed_uploads])
            plain = all(
                torch.allclose(strategy.members[0].state[k], v, atol=1e-6)
                for k, v in expected.items()
                if v.is_floating_point()
            )
            assert plain != larger_trained  # mixed exactly when a larger model had uploads
            mixed_rounds += larger_trained
    assert mixed_rounds >= 1


def test_capacity_comes_from_a_declared_budget_the_boards_speed_or_its_tier() -> None:
    seed = 1000.0
    rpi4 = BOARDS["rpi4"].sustained_gflops
    declared = DeviceInfo("a", 0, 10, profile={"budget": {"macs": 5e6}})
    emulated = DeviceInfo("b", 0, 10, profile={"emulating": {"class": "x", "gflops": 4 * rpi4}})
    replayed = DeviceInfo("c", 0, 10, profile={"device_class": "jetson-agx-orin"}, memory_budget_bytes=7)
    pinned = DeviceInfo("d", 5, 10, tier=1)
    by_index = DeviceInfo("e", 5, 10)
    assert capacity_of(declared, seed, [1, 8], 6, rpi4) == Capacity(5e6, None, "budget")
    assert capacity_of(emulated, seed, [1, 8], 6, rpi4) == Capacity(4 * seed, None, "speed")
    orin = capacity_of(replayed, seed, [1, 8], 6, rpi4)
    assert orin.source == "speed" and orin.memory_bytes == 7
    assert orin.macs / seed == pytest.approx(BOARDS["jetson-agx-orin"].sustained_gflops / rpi4)  # > 29x
    assert capacity_of(pinned, seed, [1, 8, 32], 6, rpi4).macs == 8 * seed
    assert capacity_of(by_index, seed, [1, 8, 32], 6, rpi4).macs == 32 * seed


def test_a_memory_budget_keeps_larger_models_away_but_never_the_seed_model() -> None:
    strategy = create_strategy("fedtrans", StrategyContext("tinycnn", 10, 1, 16, 4, 4, options=GROW_FAST))
    assert isinstance(strategy, FedTrans)
    grown = strategy.members[0]
    strategy.members.append(
        type(grown)(grown.config, grown.state, grown.macs * 2, grown.operations)
    )  # a second, costlier model
    tight = Capacity(1e12, memory_bytes=1, source="tier")
    assert strategy.compatible(tight) == [0]
    assert strategy.compatible(Capacity(1e12, None, "tier")) == [0, 1]
    assert strategy.compatible(Capacity(grown.macs * 1.5, None, "tier")) == [0]


def test_a_result_shaped_for_another_model_is_refused() -> None:
    strategy = create_strategy("fedtrans", StrategyContext("tinycnn", 10, 1, 16, 2, 2, options=GROW_FAST))
    device = DeviceInfo("dev-00000", 0, 10)
    task = strategy.assign(0, [device])["dev-00000"]
    forged = Task(
        task.round,
        task.device_id,
        task.spec,
        task.weights,
        task.procedure,
        task.hparams,
        None,
        task.task_id,
        "m7",
    )
    with pytest.raises(SpecError, match="names model 'm7'"):
        strategy.validate(forged, run_task(task, digits_clients(2).client("dev-00000")))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"alpha": 1.5}, r"alpha must be a number in \[0.0, 1.0\]"),
        ({"gamma": 0}, "gamma must be an integer >= 1"),
        ({"first_operation": "shrink"}, "first_operation must be one of"),
        ({"capacities": []}, "capacities must be a non-empty list"),
        ({"capacity_reference": "toaster"}, "unknown board class 'toaster'"),
        ({"widen_factor": 1.0}, "widen_factor must be > 1"),
        ({"l2s": 1}, "l2s must be bool"),
    ],
)
def test_bad_options_are_refused_by_name(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        create_strategy("fedtrans", StrategyContext("tinycnn", 10, 1, 16, 2, 2, options=options))


def test_models_fedtrans_cannot_grow_are_refused_by_name() -> None:
    with family_without_layout() as arch, pytest.raises(ConfigError, match="has no growable blocks"):
        create_strategy("fedtrans", StrategyContext(arch, 10, 3, 32, 2, 2))


def test_in_trace_replay_capacity_follows_each_boards_class(tmp_path: Path) -> None:
    """rpi4 is the reference board (the seed model); phone-mid (4.3x) and laptop (8x) can afford grown models."""
    from nestling.profiler.traces import DeviceTrace, save_traces
    from nestling.simulator.run import run_simulation

    classes = ["rpi4", "phone-mid", "laptop"]
    traces = [
        DeviceTrace(f"t{i}", classes[i % 3], 2**30, 1e6, 1e6, 0.01, gflops=0.05 * (i + 1)) for i in range(6)
    ]
    save_traces(traces, tmp_path / "fleet.jsonl")
    cfg = sim_config(5)
    cfg = config_from_dict(
        {
            **cfg.to_dict(),
            "run": {**cfg.to_dict()["run"], "traces": str(tmp_path / "fleet.jsonl"), "eval_every": 5},
        }
    )
    summary = run_simulation(cfg, tmp_path / "run")
    report = summary["method_report"]["fedtrans"]
    assert report["capacity_sources"] == {"speed": 6} and len(report["models"]) >= 2
    reference = [d for i, d in enumerate(sorted(report["deployed"])) if classes[i % 3] == "rpi4"]
    assert reference and all(report["deployed"][d] == "m0" for d in reference)
    assert any(
        model != "m0" for r in records(tmp_path / "run") for model in r["method"]["fedtrans"]["trained"]
    )
