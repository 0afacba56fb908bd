"""An agent with nothing to talk to says what it waits for (at INFO), and never claims a registration the
server has not answered."""

from __future__ import annotations

import logging
import time

import pytest
import torch

import nestling.edge.agent
from nestling.edge.agent import Agent
from nestling.edge.agent_config import agent_config_from_dict
from nestling.edge.procedures import ClientData
from nestling.server.broker import EmbeddedBroker, find_free_port


def start_agent(url: str, fleet: str) -> Agent:
    config = agent_config_from_dict(
        {
            "broker": {"url": url, "fleet": fleet},
            "device": {"id": "board-w", "memory_budget_mb": 48},
            "agent": {"heartbeat_s": 0.5},
        }
    )
    data = ClientData(torch.zeros(8, 1, 16, 16), torch.arange(8) % 2)
    return Agent(config, data).start()


def messages_within(caplog: pytest.LogCaptureFixture, needle: str, timeout_s: float) -> list[str]:
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        said = [r.getMessage() for r in caplog.records if r.name == "nestling.agent"]
        if any(needle in m for m in said):
            return said
        time.sleep(0.1)
    return [r.getMessage() for r in caplog.records if r.name == "nestling.agent"]


@pytest.fixture(autouse=True)
def quick_notices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nestling.edge.agent, "FIRST_NOTICE_S", 0.5)
    monkeypatch.setattr(nestling.edge.agent, "NOTICE_EVERY_S", 0.5)


def test_no_broker_the_agent_says_it_is_waiting_for_it(caplog: pytest.LogCaptureFixture) -> None:
    url = f"mqtt://127.0.0.1:{find_free_port()}"
    with caplog.at_level(logging.INFO, logger="nestling.agent"):
        agent = start_agent(url, "nobroker")
        try:
            said = messages_within(caplog, "waiting for the MQTT broker", 8.0)
        finally:
            agent.stop()
    assert any("waiting for the MQTT broker" in m and url in m for m in said), said


def test_broker_without_server_the_agent_waits_for_the_server(caplog: pytest.LogCaptureFixture) -> None:
    with EmbeddedBroker() as broker, caplog.at_level(logging.INFO, logger="nestling.agent"):
        agent = start_agent(broker.url, "noserver")
        try:
            said = messages_within(caplog, "waiting for the server of fleet 'noserver'", 8.0)
        finally:
            agent.stop()
    assert any("waiting for the server of fleet 'noserver'" in m for m in said), said
    assert not any("registered" in m for m in said), said
