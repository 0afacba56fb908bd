"""What a board says about itself: a memory ceiling lowered by an out-of-memory failure, and profiling state."""

from __future__ import annotations

import threading

import torch

from nestling.edge.agent_config import agent_config_from_dict
from nestling.edge.agent_link import AgentLink
from nestling.edge.agent_presence import AgentPresence
from nestling.edge.agent_profiling import AgentProfiling
from nestling.edge.monitor import ResourceMonitor
from nestling.edge.procedures import ClientData
from nestling.messages import Task
from nestling.models.config import ModelConfig
from nestling.profiler.board_profile import BoardProfile
from nestling.profiler.estimator import estimate
from nestling.spec import SubmodelSpec

MB = 1024 * 1024


def presence_for(device: dict[str, object]) -> tuple[AgentProfiling, AgentPresence]:
    config = agent_config_from_dict({"device": {"id": "board", **device}})
    profiling = AgentProfiling(config, None, on_measured=lambda: None)
    link = AgentLink(config.broker, "board", threading.Event(), on_connected=lambda: None)  # never connected
    data = ClientData(torch.zeros(6, 1, 16, 16), torch.tensor([0, 1, 2, 0, 1, 2]))
    return profiling, AgentPresence(link, config, data, ResourceMonitor("cpu"), profiling, None)


def oom_task(batch: int) -> tuple[Task, SubmodelSpec]:
    spec = SubmodelSpec.full(ModelConfig("tinycnn", image_size=16))
    return Task(0, "board", spec.to_dict(), {}, "plain", {"batch_size": batch}, task_id=f"b{batch}"), spec


def test_running_out_of_memory_caps_the_budget_and_the_measured_profile_below_the_failed_submodel() -> None:
    profiling, presence = presence_for({"memory_budget_mb": 512, "profile": False})
    hello = presence.profile()
    assert (
        hello["memory_budget_bytes"] == 512 * MB
        and hello["labels"] == [0, 1, 2]
        and "board_profile" not in hello
    )
    task, spec = oom_task(8)
    profiling.lower_memory(task, MemoryError())
    cap = int(estimate(spec, 8).training_bytes * 0.9)
    assert cap < 512 * MB and presence.profile()["memory_budget_bytes"] == cap
    profiling.lower_memory(oom_task(64)[0], MemoryError())  # a larger task failing says nothing new
    assert profiling.memory_cap == cap
    profiling.board = BoardProfile(spec.id, "tinycnn", 8, 4096 * MB, 0.2, 5.0, 0.01, (), "measured")
    assert presence.profile()["board_profile"]["memory_bytes"] == cap


def test_a_server_that_plans_nothing_from_profiles_ends_the_wait_for_one_once() -> None:
    profiling, presence = presence_for({})
    assert presence.profile()["profiling"] is True  # the default: measure the fleet's model first
    assert profiling.for_plan(None) is True  # the server must hear that no profile is coming ...
    assert presence.profile()["profiling"] is False and profiling.for_plan(None) is False  # ... once
    off, _ = presence_for({"profile": False})
    assert off.for_plan({"spec": {}, "batch": 8}) is False
