"""Fault tolerance with real processes: an agent dies mid-round, the server is SIGKILLed and resumed, the broker restarts."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from nestling.server.broker import EmbeddedBroker, find_free_port
from nestling.server.fleet import run_fleet
from nestling.server.fleet_config import load_fleet_config
from tests.server.fleet_harness import (
    FleetWatch,
    fleet_toml,
    metrics,
    spawn,
    start_agents,
    stop_all,
    wait_until,
)


@pytest.mark.slow
def test_an_agent_killed_mid_round_is_dropped_and_the_next_round_proceeds(tmp_path):
    with EmbeddedBroker() as broker:
        config = tmp_path / "fleet.toml"
        config.write_text(
            fleet_toml(broker.url, "kill-agent", devices=4, rounds=3, deadline_s=60, local_steps=30)
        )
        agents = start_agents(tmp_path, broker.url, "kill-agent", 4)
        watch = FleetWatch(broker.host, broker.port, "kill-agent")
        killed = watch.when_task(1, lambda: os.kill(agents[0].pid, signal.SIGKILL), device_id="dev-0")
        try:
            run_fleet(load_fleet_config(config))
        finally:
            watch.close()
            stop_all(agents)
    assert killed.is_set()
    first, second, third = metrics(tmp_path / "out")
    assert first["accepted"] == 4
    # Round 2 closes as soon as the last will says dev-0 is gone, long before its 60 s deadline.
    assert second["counters"].get("dropouts") == 1 and second["accepted"] == 3 and second["aggregated"]
    assert second["wall_seconds"] < 30
    assert third["selected"] == 3 and third["accepted"] == 3 and third["aggregated"]


@pytest.mark.slow
def test_a_server_killed_mid_round_resumes_and_agents_come_back_by_themselves(tmp_path):
    with EmbeddedBroker() as broker:
        config = tmp_path / "fleet.toml"
        config.write_text(fleet_toml(broker.url, "kill-server", devices=3, rounds=4, local_steps=20))
        agents = start_agents(tmp_path, broker.url, "kill-server", 3)
        server = spawn("nestling.server.fleet", ["--config", str(config)], tmp_path / "server-1.log")
        watch = FleetWatch(broker.host, broker.port, "kill-server")
        killed = watch.when_task(1, lambda: os.kill(server.pid, signal.SIGKILL))
        try:
            wait_until(killed.is_set, 120, "round 2's first task")
            server.wait(10)
            before = metrics(tmp_path / "out")
            resumed = spawn(
                "nestling.server.fleet", ["--config", str(config), "--resume"], tmp_path / "server-2.log"
            )
            assert resumed.wait(120) == 0, (tmp_path / "server-2.log").read_text()[-3000:]
            assert all(agent.poll() is None for agent in agents)  # nobody restarted the agents
        finally:
            watch.close()
            stop_all(agents)
    after = metrics(tmp_path / "out")
    assert [r["round"] for r in before] == [0]
    assert [r["round"] for r in after] == [0, 1, 2, 3]  # no round lost, none counted twice
    assert all(r["aggregated"] for r in after) and after[0] == before[0]
    assert "resuming after round 1 of 4" in (tmp_path / "server-2.log").read_text()
    greeted = "sending it this board's hello"  # once to each server process: the first and the resumed one
    assert all((tmp_path / f"agent-{i}.log").read_text().count(greeted) >= 2 for i in range(3))


@pytest.mark.slow
def test_a_broker_restart_mid_run_is_survived_by_server_and_agents(tmp_path):
    port = find_free_port()
    url = f"mqtt://127.0.0.1:{port}"
    broker = EmbeddedBroker(port=port).start()
    config = tmp_path / "fleet.toml"
    config.write_text(
        fleet_toml(url, "restart", devices=3, rounds=4, deadline_s=60, local_steps=20)
    )  # a busy box stays inside it
    agents = start_agents(tmp_path, url, "restart", 3)
    try:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(run_fleet, load_fleet_config(config))
            watch = FleetWatch("127.0.0.1", port, "restart")
            wait_until(lambda: watch.status == ("training", 1), 120, "round 2 to start")
            watch.close()
            broker.stop()
            time.sleep(2.0)  # everyone notices the broker is gone and starts retrying
            broker = EmbeddedBroker(port=port).start()
            summary = running.result(timeout=240)
        assert all(agent.poll() is None for agent in agents)
    finally:
        stop_all(agents)
        broker.stop()
    records = metrics(tmp_path / "out")
    assert [r["round"] for r in records] == [0, 1, 2, 3] and summary["rounds"] == 4
    assert records[-1]["aggregated"] and records[-1]["accepted"] == 3
    for i in range(3):  # each agent lost the broker, then reconnected and said hello again on its own
        log = (tmp_path / f"agent-{i}.log").read_text()
        assert "hello sent" in log.split("lost the broker", 1)[1]
