"""What the board measured of itself: the profile of the fleet's model, and a memory ceiling an OOM lowered.

The server announces the model it plans from (ServerStatus.plan); the board measures it once per model
and batch (or reads its cache, edge/self_profile.py) in the background, saying `profiling` in its hello
meanwhile so the server does not count it yet. An out-of-memory failure caps what the board says
training may use below the submodel that failed, so the server plans a smaller one from then on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from nestling.edge.agent_config import AgentConfig, state_dir
from nestling.edge.emulation import EmulationTarget
from nestling.edge.self_profile import CACHE_NAME, ProfileInputs, board_profile
from nestling.messages import Task
from nestling.profiler.board_profile import BoardProfile
from nestling.profiler.estimator import estimate
from nestling.spec import SubmodelSpec

log = logging.getLogger("nestling.agent")


class AgentProfiling:
    """The measured profile, the key it was made for, whether a measurement is under way, the memory cap.

    `on_measured()` runs after each measurement (or failed attempt): the server must hear a new hello."""

    def __init__(
        self, config: AgentConfig, emulation: EmulationTarget | None, on_measured: Callable[[], None]
    ) -> None:
        self.config = config
        self.emulation = emulation
        self._on_measured = on_measured
        self.board: BoardProfile | None = None
        self.profiling = bool(config.device.profile)
        self.memory_cap: int | None = None
        self._key: str | None = None

    def for_plan(self, plan: dict[str, Any] | None) -> bool:
        """Have a profile of the model the server announced: the cached one, else measure it (in the
        background). True when the server must hear a new hello."""
        device = self.config.device
        if not device.profile:
            return False
        if plan is None:  # the server plans nothing from profiles: do not keep it waiting
            was, self.profiling = self.profiling, False
            return was
        emulate = (
            None
            if self.emulation is None
            else self.emulation.name
            + (f"/{self.emulation.trace_device}" if self.emulation.trace_device else "")
        )
        inputs = ProfileInputs(
            plan["spec"], plan["batch"], device.torch_device, device.profile_margin, emulate
        )
        key = inputs.key()
        if key == self._key:
            return False
        self._key, self.profiling = key, True
        threading.Thread(target=self._measure, args=(inputs,), name="agent-profile", daemon=True).start()
        return True

    def _measure(self, inputs: ProfileInputs) -> None:
        cache = state_dir(self.config) / CACHE_NAME
        try:
            board, fresh = board_profile(
                inputs, cache, self.emulation, repeats=self.config.device.profile_repeats
            )
            self.board = board
            # an emulated board's figures are its class's, computed, not measured on this machine
            kind = "emulated" if self.emulation is not None else "measured"
            log.info(
                "%s profile of %s at batch %d (%s): %.0f MB for training, %.1f GFLOP/s, step %.1f ms",
                kind if fresh else f"cached {kind}",
                board.arch,
                board.batch,
                board.source,
                board.memory_bytes / 1e6,
                board.gflops,
                board.step_s * 1000,
            )
        except Exception:  # a profile the board cannot make: the server sizes it as before
            log.exception("could not profile the fleet's model")
        self.profiling = False
        self._on_measured()

    def board_fields(self) -> dict[str, Any]:
        """The measured profile as the hello carries it, capped by what an out-of-memory taught."""
        if self.board is None:
            return {}
        board = self.board.to_dict()
        if self.memory_cap is not None:
            board["memory_bytes"] = min(board["memory_bytes"], self.memory_cap)
        return board

    def lower_memory(self, task: Task, exc: BaseException) -> None:
        """Cap what training may use below the submodel `task` ran out of memory on."""
        spec = SubmodelSpec.from_dict(task.spec)
        batch = int(task.hparams.get("batch_size", self.board.batch if self.board else 32))
        needed = estimate(spec, batch).training_bytes
        cap = int(needed * 0.9)
        self.memory_cap = cap if self.memory_cap is None else min(cap, self.memory_cap)
        log.error(
            "task %s ran out of memory (%s): telling the server to plan under %.1f MB",
            task.task_id,
            type(exc).__name__,
            self.memory_cap / 1e6,
        )
