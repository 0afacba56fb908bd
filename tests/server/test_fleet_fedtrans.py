"""FedTrans on a real fleet: `nestling server` and four `nestling agent` processes over the embedded broker.

The family grows mid-run (γ = δ = 1 and a β every slope meets: the seed model grows once it has two rounds of
losses), and boards then receive tasks whose spec carries the grown architecture, build it, train it and send
it back; the server accepts and aggregates every result."""

from __future__ import annotations

import json

import pytest

from nestling.server.broker import EmbeddedBroker
from nestling.server.fleet import run_fleet
from nestling.server.fleet_config import load_fleet_config
from tests.server.fleet_harness import fleet_toml, metrics, start_agents, stop_all

AGENTS = 4
GROW_FAST = "gamma = 1\ndelta = 1\nbeta = 10.0\ncapacities = [8]"  # every board may draw every model


@pytest.mark.slow  # four agent processes and a server: about a minute on this 2-core machine
def test_a_fleet_grows_its_family_mid_run_and_boards_train_the_grown_models(tmp_path) -> None:
    with EmbeddedBroker() as broker:
        config = tmp_path / "fleet.toml"
        config.write_text(
            fleet_toml(
                broker.url,
                "fedtrans",
                devices=AGENTS,
                rounds=4,
                method="fedtrans",
                method_options=GROW_FAST,
                quorum=1.0,
            )
        )
        agents = start_agents(tmp_path, broker.url, "fedtrans", AGENTS, budgets=[64.0] * AGENTS)
        try:
            summary = run_fleet(load_fleet_config(config))
        finally:
            stop_all(agents)
    records = metrics(tmp_path / "out")
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    assert all(r["aggregated"] and r["accepted"] == AGENTS for r in records)
    assert not {k: v for k, v in summary["transport"].items() if k.startswith("rejected_")}
    reports = [r["method"]["fedtrans"] for r in records]
    assert reports[1]["born"]["id"] == "m1" and reports[1]["born"]["parent"] == "m0"
    grown_uploads = sum(
        n for report in reports[2:] for model, n in report["trained"].items() if model != "m0"
    )
    assert grown_uploads > 0  # boards built, trained and returned a grown architecture
    family = summary["method_report"]["fedtrans"]["models"]
    assert [m["id"] for m in family][:2] == ["m0", "m1"] and sum(m["uploads"] for m in family[1:]) > 0
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["method_report"]["fedtrans"]["models"]
