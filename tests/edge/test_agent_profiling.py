"""An emulated board's profile is its class's figures: the agent says "emulated", never "measured"."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from nestling.edge.agent_cli import resolve_emulation
from nestling.edge.agent_config import agent_config_from_dict
from nestling.edge.agent_profiling import AgentProfiling
from nestling.models.config import ModelConfig
from nestling.spec import SubmodelSpec


def test_an_emulated_profile_is_logged_as_emulated(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = agent_config_from_dict({"device": {"id": "b", "emulate": "rpi4", "state_dir": str(tmp_path)}})
    done = threading.Event()
    profiling = AgentProfiling(config, resolve_emulation(config.device), on_measured=done.set)
    spec = SubmodelSpec.full(ModelConfig("tinycnn", num_classes=10, in_channels=1, image_size=16))
    with caplog.at_level(logging.INFO, logger="nestling.agent"):
        assert profiling.for_plan({"spec": spec.to_dict(), "batch": 8})
        assert done.wait(60)
    said = [r.getMessage() for r in caplog.records if "profile of tinycnn" in r.getMessage()]
    assert said and said[0].startswith("emulated profile") and "measured" not in said[0], said
