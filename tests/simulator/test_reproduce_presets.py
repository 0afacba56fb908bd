"""The shipped reproduction presets (issue 29): tiers go to the same clients in every method of a comparison,
the equal-compute FeDepth variants take about HeteroFL's steps, DynamicFL trains what it modulates, the models
the notes name are the ones built, and FedTrans's HeteroFL phase derives from FedTrans's finished run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from nestling.errors import ConfigError
from nestling.server.strategies import DeviceInfo, StrategyContext, create_strategy
from nestling.server.strategies.base import Strategy
from nestling.server.strategies.fedepth import FeDepth
from nestling.server.strategies.fedtrans import FedTrans
from nestling.server.strategies.heterofl import HeteroFL
from nestling.simulator.reproduce import SCALES, known_comparisons, load_comparison
from nestling.simulator.reproduce_derive import heterofl_on_fedtrans_largest
from nestling.slicing import shapes_for
from nestling.spec import SubmodelSpec
from tests.simulator.reproduce_helpers import preset_strategy


def _strategy(comparison_name: str, scale: str, label: str, **config_changes: object) -> Strategy:
    comparison = load_comparison(comparison_name, scale)
    return preset_strategy(comparison, comparison.entry(label), **config_changes)


@pytest.mark.parametrize("scale", SCALES)
def test_fedepth_tiers_go_to_the_same_clients_as_heterofls_widths(scale: str) -> None:
    heterofl = _strategy("fedepth", scale, "heterofl")
    assert isinstance(heterofl, HeteroFL)
    for label in ("fedepth", "m-fedepth", "fedepth-split", "m-fedepth-split"):
        fedepth = _strategy("fedepth", scale, label)
        assert isinstance(fedepth, FeDepth)
        for index in range(heterofl.ctx.num_clients):
            device = DeviceInfo(f"dev-{index:05d}", index, 500)
            ratio = fedepth.ratios[fedepth.tier_of(device)]
            assert heterofl.rate_of(0, device) == pytest.approx(ratio, rel=1e-5), (label, index)


def test_the_split_variants_share_the_local_budget_out_over_the_stages() -> None:
    comparison = load_comparison("fedepth", "small")
    for label in ("fedepth-split", "m-fedepth-split"):
        assert comparison.config(comparison.entry(label), 0).method.options["stage_steps"] == "split"
    for label in ("fedepth", "m-fedepth"):  # the paper's protocol: every stage the whole budget
        assert (
            comparison.config(comparison.entry(label), 0).method.options.get("stage_steps", "full") == "full"
        )
    assert {"fedepth-split > heterofl on full", "m-fedepth-split > heterofl on full"} <= {
        str(c) for c in comparison.claims
    }


@pytest.mark.parametrize("scale", SCALES)
def test_dynamicfl_trains_at_least_two_epochs_so_the_modulated_structure_is_trained(scale: str) -> None:
    cfg = load_comparison("dynamicfl", scale).config(
        load_comparison("dynamicfl", scale).entry("dynamicfl"), 0
    )
    assert cfg.train.local_steps is None and cfg.train.local_epochs >= 2


def test_a_note_that_names_the_cifar_stem_builds_the_cifar_stem_model() -> None:
    for name in known_comparisons():
        for scale in SCALES:
            comparison = load_comparison(name, scale)
            if "CIFAR stem" in comparison.note:
                assert comparison.shared["model"]["arch"] == "resnet18-cifar", (name, scale)


def _fedtrans_summary(run: Path, layout: dict[str, list[int]], seed_macs: int) -> None:
    run.mkdir(parents=True)
    models = [
        {"id": "m0", "macs": seed_macs, "stage_blocks": [1, 1], "block_hidden": [16, 32]},
        {"id": "m1", "macs": 3 * seed_macs, **layout},
    ]
    (run / "summary.json").write_text(json.dumps({"method_report": {"fedtrans": {"models": models}}}))


def test_heterofl_derives_fedtrans_largest_model_and_one_rate_per_tier_in_fedtrans_order(
    tmp_path: Path,
) -> None:
    from nestling.config import config_from_dict

    source = config_from_dict(
        {
            "data": {"dataset": "digits", "clients": 6, "limit_train": 120, "limit_test": 30},
            "model": {"arch": "tinycnn"},
            "method": {"name": "fedtrans", "capacities": [1, 2, 8]},
        }
    )
    layout = {"stage_blocks": [1, 2], "block_hidden": [32, 32, 16]}
    strategy = create_strategy(
        "fedtrans", StrategyContext("tinycnn", 10, 1, 16, 6, 40, options={"capacities": [1, 2, 8]})
    )
    assert isinstance(strategy, FedTrans)
    seed_macs = strategy.members[0].macs  # tinycnn on 16x16 digits, as FedTrans measured it
    _fedtrans_summary(tmp_path / "fedtrans", layout, seed_macs)
    options, model = heterofl_on_fedtrans_largest(source, tmp_path / "fedtrans")
    assert model == {"extra": {"layout": layout}}
    letters = [part[0] for part in options["mix"].split("-")]
    assert len(letters) == 3 and letters == sorted(
        letters, reverse=True
    )  # narrowest rate on the weakest tier
    assert letters[-1] == "a"  # 8x the seed model's MACs affords the whole grown model (3x)
    # HeteroFL's mix hands out its rates by client index in the order given: tier k is FedTrans's tier k
    heterofl = create_strategy(
        "heterofl", StrategyContext("tinycnn", 10, 1, 16, 6, 10, options={"mix": options["mix"]})
    )
    assert isinstance(heterofl, HeteroFL)
    rates = {"a": 1.0, "b": 0.5, "c": 0.25, "d": 0.125, "e": 0.0625}
    for index in range(6):
        device = DeviceInfo(f"dev-{index:05d}", index, 20)
        tier = [1.0, 2.0, 8.0].index(strategy.capacity(device).macs / seed_macs)
        assert heterofl.rate_of(0, device) == rates[letters[tier]]
    with pytest.raises(ConfigError, match="FedTrans must finish"):
        heterofl_on_fedtrans_largest(source, tmp_path / "missing")


TINY_FEDTRANS = """
name = "fedtrans-tiny"
title = "FedTrans then HeteroFL on its largest model, on digits"
source = "a test"
metrics = ["clients", "full"]
claims = ["fedtrans > heterofl on clients"]

[[methods]]
label = "fedtrans"
method = "fedtrans"
options = { capacities = [1, 8], gamma = 1, delta = 1, beta = 10.0 }

[[methods]]
label = "heterofl"
method = "heterofl"
derive = { from = "fedtrans", rule = "fedtrans-largest" }

[scales.small]
run = { rounds = 3, eval_every = 3, workers = 1, min_update_cosine = -1.0, quorum = 0.5 }
data = { dataset = "digits", partition = "iid", clients = 4, limit_train = 160, limit_test = 60 }
model = { arch = "tinycnn" }
train = { fraction = 1.0, local_steps = 2, batch_size = 10, lr = 0.05, momentum = 0.0, schedule = "constant" }
"""


@pytest.mark.slow
def test_the_fedtrans_comparison_runs_both_phases_in_one_command(tmp_path: Path) -> None:
    """~30 s: FedTrans grows, then HeteroFL trains its largest model; both are judged on the clients' mean."""
    from nestling.simulator.reproduce_cli import reproduce

    preset = tmp_path / "fedtrans-tiny.toml"
    preset.write_text(TINY_FEDTRANS)
    comparison = load_comparison(str(preset), "small")
    out = tmp_path / "out"
    runs, _files, last = reproduce(comparison, [0], out, quiet=True)
    assert {r.label for r in runs} == {"fedtrans", "heterofl"}
    grown = json.loads((out / "seed-0" / "fedtrans" / "summary.json").read_text())
    largest = grown["method_report"]["fedtrans"]["models"][-1]
    assert len(grown["method_report"]["fedtrans"]["models"]) > 1  # the family grew
    heterofl = (out / "seed-0" / "heterofl" / "config.toml").read_text()
    assert f"block_hidden = {largest['block_hidden']}" in heterofl and 'mix = "' in heterofl
    assert "ordering_held=" in last and "fedtrans_clients=" in last
    assert all(r.compute["steps_max"] == 2 for r in runs)


def _tier_rank(strategy: Strategy, device: DeviceInfo) -> int:
    """Which of the method's submodels (ranked by parameter count, smallest 0) the device deploys."""
    sizes = sorted({_parameters(s) for s in _all_specs(strategy)})
    return sizes.index(_parameters(strategy.deploy_spec(device, 0)))


def _all_specs(strategy: Strategy) -> list[SubmodelSpec]:
    specs = strategy.specs
    return list(specs.values()) if isinstance(specs, dict) else list(specs)


def _parameters(spec: SubmodelSpec) -> int:
    return sum(math.prod(shape) for shape in shapes_for(spec).values())


@pytest.mark.parametrize(
    ("comparison_name", "scale"), [("nefl", "small"), ("nefl", "paper"), ("scalefl", "small")]
)
def test_every_method_of_a_comparison_gives_tier_k_to_the_same_clients(
    comparison_name: str, scale: str
) -> None:
    """Issue 29 item 5: NeFL's, FjORD's and HeteroFL's tiers (ScaleFL's, HeteroFL's and DepthFL's levels) land on
    the same clients, smallest first by client index, so a per-tier difference is the method's, not the data's."""
    comparison = load_comparison(comparison_name, scale)
    strategies = {m.label: _strategy(comparison_name, scale, m.label) for m in comparison.entries}
    clients = next(iter(strategies.values())).ctx.num_clients
    ranks = {
        label: [_tier_rank(s, DeviceInfo(f"dev-{i:05d}", i, 500)) for i in range(clients)]
        for label, s in strategies.items()
    }
    for label, by_client in ranks.items():  # smallest first, rising with the client index
        assert by_client[0] == 0 and by_client == sorted(by_client), label
    tiers = {label: len(_all_specs(s)) for label, s in strategies.items()}
    most = max(tiers.values())
    same = [label for label, n in tiers.items() if n == most]
    assert len(same) >= 2
    for label in same:  # the methods with as many tiers: tier k on the same clients
        assert ranks[label] == ranks[same[0]], (label, same[0])
    # DepthFL has one depth per stage (3 on ResNet-20 against 4 levels): its thirds still rise with the index


@pytest.mark.parametrize("scale", SCALES)
def test_dynamicfl_judges_the_gain_by_capacity_on_single_class_runs(scale: str) -> None:
    """METHODS §5.c: "DynamicFL >= FedAvg and the gain grows with capacity". The gain of capacity c is a run with
    every board at c against FedAvg on the same seed (capacity 0 is FedAvg), so the preset runs c = 1 and c = 2
    and claims c1 > FedAvg and c2 > c1; the mixed run keeps the released code's thirds."""
    comparison = load_comparison("dynamicfl", scale)
    capacities = {
        label: comparison.config(comparison.entry(label), 0).method.options["capacities"]
        for label in ("dynamicfl", "dynamicfl-c1", "dynamicfl-c2")
    }
    assert [list(c) for c in capacities.values()] == [[0, 1, 2], [1], [2]]
    assert {"dynamicfl-c1 > fedavg on full", "dynamicfl-c2 > dynamicfl-c1 on full"} <= {
        str(c) for c in comparison.claims
    }
