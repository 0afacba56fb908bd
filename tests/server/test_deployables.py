"""Which submodel each board deploys when a run ends, the orders that carry it, and the summary's rows."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from nestling.errors import ConfigError
from nestling.server.deployables import (
    ExportLedger,
    deployable_rows,
    deployable_target,
    deployables_table,
    export_orders,
    wants_export,
)
from nestling.server.fleet_config import fleet_config_from_dict
from nestling.server.registry import DeviceRecord
from nestling.server.strategies import create_strategy
from nestling.server.strategies.base import DeviceInfo
from nestling.wire.export_messages import ExportReport

ASKS = {"export": {"on_finish": True, "format": "onnx"}}


def device(device_id: str, index: int, tier: int | None = None, **profile) -> DeviceInfo:
    return DeviceInfo(device_id, index, 50, profile=profile or None, tier=tier)


@pytest.mark.parametrize(
    "profile, wanted",
    [
        (ASKS, True),
        ({"export": {"on_finish": False}}, False),
        ({"export": {"on_finish": "yes"}}, False),
        ({"export": True}, False),
        ({}, False),
        (None, False),
    ],
)
def test_only_a_hello_that_asks_plainly_wants_an_export(profile, wanted):
    assert wants_export(profile) is wanted


def test_a_nefl_board_deploys_its_own_tier_with_that_submodels_own_bn_and_steps(make_ctx):
    strategy = create_strategy("nefl-wd", make_ctx())  # flex 2: rounds draw neighbours of the tier
    targets = strategy.eval_targets()
    for k in range(5):
        target = deployable_target(strategy, device(f"b{k}", 0, tier=k), 3, targets)
        assert target is targets[k] and target.name == f"k{k + 1}"
    own = next(k for k in strategy.stores[1] if k.endswith("norm.weight") or ".bn" in k)
    strategy.stores[1][own].fill_(3.0)  # k2's own BN differs from the global (k5's) one
    order = export_orders(strategy, [device("b1", 0, tier=1, **ASKS)], 3, "requested")[0]
    assert torch.equal(order.weights[own], torch.full_like(order.weights[own], 3.0))
    assert all(torch.equal(order.weights[k], v) for k, v in strategy.eval_targets()[1].state.items())
    assert (order.name, order.spec_id, order.round, order.method) == ("k2", targets[1].spec.id, 3, "nefl-wd")


def test_flags_of_the_evaluated_target_travel_with_the_order(make_ctx):
    fjord = create_strategy("fjord", make_ctx())
    order = export_orders(fjord, [device("b", 7)], 0, "all")[0]
    assert order.active_width == max(fjord.widths) and order.name == f"p{max(fjord.widths):g}"
    depthfl = create_strategy("depthfl", make_ctx())
    assert export_orders(depthfl, [device("b", 0)], 0, "all")[0].ensemble is True
    heterofl = create_strategy("heterofl", make_ctx())
    assert export_orders(heterofl, [device("b", 0)], 0, "all")[0].static_bn is True


def test_a_spec_the_method_does_not_evaluate_is_sliced_from_the_deployable_full_model(make_ctx, monkeypatch):
    strategy = create_strategy("nefl-wd", make_ctx())
    odd = replace(strategy.full_spec, width=0.4)
    monkeypatch.setattr(strategy, "deploy_spec", lambda board, last_round: odd)
    target = deployable_target(strategy, device("b", 0), 0, strategy.eval_targets())
    assert target.name == f"spec-{odd.id}" and target.spec == odd
    full = strategy.global_export_state()
    weight = next(k for k, v in target.state.items() if v.dim() == 4)
    assert torch.equal(
        target.state[weight], full[weight][tuple(slice(0, n) for n in target.state[weight].shape)]
    )


def test_orders_go_to_boards_that_asked_or_to_every_board(make_ctx):
    strategy = create_strategy("fedavg", make_ctx())
    boards = [device("a", 0, **ASKS), device("b", 1), device("c", 2, **ASKS)]
    assert [o.device_id for o in export_orders(strategy, boards, 0, "requested")] == ["a", "c"]
    assert [o.device_id for o in export_orders(strategy, boards, 0, "all")] == ["a", "b", "c"]
    assert export_orders(strategy, boards, 0, "off") == []


def report(**changes) -> ExportReport:
    made = ExportReport(
        "a",
        "export-r0-a",
        "spec-a",
        "ok",
        submodel="full",
        models=["onnx"],
        bundle="/b/a",
        parity={"onnx_fp32": {"max_abs": 1e-7, "max_rel": 2e-7, "top1_agreement": 1.0}},
        latency_ms={"batch_1": {"onnxruntime": {"p50_ms": 0.25, "p90_ms": 0.5}}},
    )
    for key, value in changes.items():
        setattr(made, key, value)
    return made


def ledger_with_orders(make_ctx) -> ExportLedger:
    strategy = create_strategy("fedavg", make_ctx())
    ledger = ExportLedger()
    for order in export_orders(strategy, [device("a", 0), device("b", 1)], 0, "all"):
        ledger.sent(order, None)
    return ledger


def test_the_ledger_admits_one_report_per_order_and_names_every_refusal(make_ctx):
    ledger = ledger_with_orders(make_ctx)
    spec_id = ledger.orders["a"].spec_id
    assert ledger.pending() == ["a", "b"]
    assert ledger.admit("b", report(spec_id=spec_id), "s", "s") == "wrong_device"  # a's report on b's topic
    assert ledger.admit("a", report(spec_id=spec_id), "old", "s") == "stale_session"
    assert ledger.admit("a", report(spec_id=spec_id, order_id="export-r9-a"), "s", "s") == "unknown_export"
    assert ledger.admit("z", report(device_id="z"), "s", "s") == "unknown_export"
    assert ledger.admit("a", report(spec_id="other"), "s", "s") == "wrong_spec"
    assert ledger.admit("a", report(spec_id=spec_id), "s", "s") is None
    assert ledger.admit("a", report(spec_id=spec_id), "s", "s") == "duplicate"
    assert ledger.pending() == ["b"]
    failed = report(
        device_id="b", order_id="export-r0-b", spec_id="invalid-spec", status="failed", error="boom"
    )
    assert ledger.admit("b", failed, "s", "s") is None and ledger.pending() == []


def test_the_summary_lists_every_registered_device_reported_or_not(make_ctx):
    ledger = ledger_with_orders(make_ctx)
    ledger.admit("a", report(spec_id=ledger.orders["a"].spec_id), "s", "s")
    records = {
        d: DeviceRecord(device(d, i, **(ASKS if d in "ae" else {})), online=d != "e", last_seen=0.0)
        for i, d in enumerate("abcde")
    }
    rows = {r["device_id"]: r for r in deployable_rows(records, ledger)}
    assert rows["a"]["status"] == "ok" and rows["a"]["bundle"] == "/b/a"
    assert rows["b"] == {
        "device_id": "b",
        "status": "no report",
        "submodel": "full",
        "spec_id": ledger.orders["b"].spec_id,
        "order_id": "export-r0-b",
    }
    assert rows["c"] == {"device_id": "c", "status": "not requested"} and rows["e"]["status"] == "offline"
    table = deployables_table(list(rows.values())).splitlines()
    assert table[0].split()[:3] == ["device", "status", "submodel"]
    assert table[1].split() == ["a", "ok", "full", "onnx", "2.0e-07", "0.250", "onnxruntime", "/b/a"]
    assert table[2].split()[:3] == ["b", "no", "report"] and table[5].split()[:2] == ["e", "offline"]


def test_fleet_toml_export_table(tmp_path):
    opened = {"enrolment": {"open": True}}
    assert fleet_config_from_dict(opened, tmp_path).export.on_finish == "off"
    config = fleet_config_from_dict(
        {**opened, "export": {"on_finish": "requested", "timeout_s": 30}}, tmp_path
    )
    assert (config.export.on_finish, config.export.timeout_s) == ("requested", 30.0)
    assert config.to_dict()["export"] == {"on_finish": "requested", "timeout_s": 30.0}
    for table, message in (
        ({"on_finish": "always"}, "on_finish must be one of off, requested, all"),
        ({"timeout_s": 0}, "timeout_s > 0"),
        ({"format": "onnx"}, "unknown keys"),
    ):
        with pytest.raises(ConfigError, match=message):
            fleet_config_from_dict({**opened, "export": table}, tmp_path)
