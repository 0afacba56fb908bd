"""Board sizing, one job of a strategy: the largest submodel a board's memory (and, with a measured profile and a
deadline, its predicted training time) holds, and the closed loop that corrects each board's predicted speed
by what it was seen to do. Its state (speed factors, last choices) goes into every checkpoint's `planning`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

from nestling.errors import ConfigError
from nestling.messages import Task
from nestling.profiler.board_profile import BoardProfile
from nestling.profiler.fit import PINNED, Fit, SpeedFeedback, fit_member
from nestling.profiler.planner import device_memory_budget, member_for_budget
from nestling.profiler.speed import samples_trained, steps_trained
from nestling.server.strategies.context import DeviceInfo, StrategyContext
from nestling.spec import SubmodelSpec


@dataclass
class SizingMemory:
    """What the closed loop remembers: each board's speed factor, this round's fits and last round's choices."""

    feedback: SpeedFeedback = field(default_factory=SpeedFeedback)
    fits: dict[str, tuple[Fit, str]] = field(default_factory=dict)  # this round's fit per board, its spec id
    chosen: dict[str, str] = field(default_factory=dict)  # the spec id each board's fit chose last (re-plans)


class BoardSizing:
    """Sizes boards by budget and profile and learns their speed; every strategy has it, methods that size
    their boards call `fit_by_budget`, the others still get each profiled board's plan and prediction."""

    ctx: StrategyContext
    full_spec: SubmodelSpec
    # What a profiled board's plan says when the method does not size it with `fit_by_budget`.
    sizing_reason: ClassVar[str] = "not sized"

    @cached_property
    def sizing_memory(self) -> SizingMemory:
        return SizingMemory()

    @property
    def feedback(self) -> SpeedFeedback:
        """Observed / predicted training time per board (the coordinator feeds it)."""
        return self.sizing_memory.feedback

    @property
    def batch_size(self) -> int:
        return self.ctx.batch_size

    @property
    def time_budget_s(self) -> float | None:
        """Seconds of local training a board may plan for: the deadline's training share."""
        if self.ctx.deadline_s is None:
            return None
        return float(self.ctx.deadline_s) * float(self.ctx.train_share)

    def board_of(self, device: DeviceInfo) -> BoardProfile | None:
        """The device's profile when it measured this run's full model at this run's batch size."""
        board = device.board
        if board is None or board.spec_id != self.full_spec.id or board.batch != self.batch_size:
            return None
        return board

    def memory_budget_of(self, device: DeviceInfo) -> int | None:
        """Hand-set budget (it wins), else the profile's recorded budget, else what the board measured."""
        budget = device_memory_budget(device.memory_budget_bytes, device.profile)
        if budget is not None:
            return budget
        board = self.board_of(device)
        return None if board is None else board.memory_bytes

    def sized_by_fit(self, device: DeviceInfo) -> bool:
        """Whether `fit_by_budget` sizes this device (a budget, or a profile without a pinned tier)."""
        if device_memory_budget(device.memory_budget_bytes, device.profile) is not None:
            return True
        return self.board_of(device) is not None and device.tier is None

    def fit_by_budget(self, device: DeviceInfo, specs: list[SubmodelSpec]) -> int | None:
        """Index of the largest spec that fits the device (profiler.fit.fit_member): its estimated training
        memory within the registered budget (or what the board measured), and, when the board sent a profile
        and the run has a deadline, its predicted local training time within the deadline's training share.
        The cheapest when none fits; None when the device registered neither a budget nor a profile, or the
        enrolment pinned its tier (the operator's word wins over what a board says of itself). The choice and
        its reason are kept for the round's record (`plan_report`)."""
        memory = self.sizing_memory
        budget = device_memory_budget(device.memory_budget_bytes, device.profile)
        board = self.board_of(device)
        if device.tier is not None:
            if board is not None:
                memory.fits[device.device_id] = (Fit(-1, PINNED, 0, None), "")
            return None
        if board is None:  # a hand-set budget only: the planner's rule as it always was (nothing: no sizing)
            return None if budget is None else member_for_budget(specs, budget, self.batch_size)
        previous = memory.chosen.get(device.device_id)
        current = next((k for k, s in enumerate(specs) if s.id == previous), None)
        fit = fit_member(
            specs,
            self.batch_size,
            memory_budget=budget,
            board=board,
            samples=samples_trained(self.ctx.local, device.num_samples),
            steps=steps_trained(self.ctx.local, device.num_samples),
            time_budget_s=self.time_budget_s,
            speed=memory.feedback.factor(device.device_id),
            current=current,
        )
        memory.fits[device.device_id] = (fit, specs[fit.index].id)
        return fit.index

    def plan_report(
        self, round_index: int, devices: list[DeviceInfo], tasks: dict[str, Task]
    ) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
        """Per profiled board: the task's spec, why it was chosen, the predicted training time (raw and
        corrected); and the re-plans (a board whose sizing chose another spec than last round)."""
        memory = self.sizing_memory
        plans: dict[str, dict[str, Any]] = {}
        replans: list[dict[str, Any]] = []
        for device in devices:
            task, board = tasks.get(device.device_id), self.board_of(device)
            if task is None or board is None:
                continue
            fit, chosen = memory.fits.get(device.device_id, (None, ""))
            raw = board.train_seconds(
                SubmodelSpec.from_dict(task.spec),
                samples_trained(task.hparams, device.num_samples),
                steps_trained(task.hparams, device.num_samples),
            )
            speed = memory.feedback.factor(device.device_id)
            plans[device.device_id] = {
                "spec": task.spec_id,
                "reason": fit.reason if fit is not None else self.sizing_reason,
                "predicted_s": raw * speed,
                "raw_predicted_s": raw,
                "speed": speed,
                "memory_bytes": fit.memory_bytes if fit is not None else None,
                "budget_bytes": self.memory_budget_of(device),
                "time_budget_s": self.time_budget_s,
                "source": board.source,
            }
            if fit is not None and chosen:
                before = memory.chosen.get(device.device_id)
                if before is not None and before != chosen:
                    replans.append(
                        {
                            "device": device.device_id,
                            "from": before,
                            "to": chosen,
                            "reason": fit.reason,
                            "speed": speed,
                        }
                    )
                memory.chosen[device.device_id] = chosen
        memory.fits = {}
        return plans, replans

    def observe_training(
        self, plans: dict[str, dict[str, Any]], observed: dict[str, tuple[float, bool]]
    ) -> None:
        """Fold each planned board's observed training time (seconds, censored by the deadline) into its
        speed factor; the plan entries gain `observed_s`, `censored` and the new `speed_after`."""
        for device_id, (seconds, censored) in observed.items():
            plan = plans.get(device_id)
            if plan is None:
                continue
            plan["observed_s"], plan["censored"] = seconds, censored
            plan["speed_after"] = self.feedback.observe(device_id, plan["raw_predicted_s"], seconds, censored)

    def planning_state(self) -> dict[str, Any]:
        """What the closed loop learned, for checkpoints: each board's speed factor and the spec its sizing
        chose last (a resumed run plans, corrects and reports re-plans exactly as an uninterrupted one)."""
        return {"speed": dict(self.feedback.factors), "chosen": dict(self.sizing_memory.chosen)}

    def load_planning_state(self, state: dict[str, Any]) -> None:
        """Restore `planning_state`; a checkpoint from before the closed loop restores nothing."""
        speed, chosen = state.get("speed", {}), state.get("chosen", {})
        if not isinstance(speed, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf
            for v in speed.values()
        ):
            raise ConfigError("checkpoint planning.speed must map boards to positive speed factors")
        if not isinstance(chosen, dict) or not all(isinstance(v, str) for v in chosen.values()):
            raise ConfigError("checkpoint planning.chosen must map boards to spec ids")
        self.feedback.factors = {str(k): float(v) for k, v in speed.items()}
        self.sizing_memory.chosen = {str(k): v for k, v in chosen.items()}
