"""Which of a round's results may be aggregated: each is admitted or refused as it arrives (its round and task,
the strategy's validation, its sample count, the absolute update bounds), and the admitted ones are screened
together when the round closes (server/round_screen.py applies the screens in order)."""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

import torch

from nestling.errors import NestlingError
from nestling.messages import Result, Task
from nestling.server.refusals import RefusalLog
from nestling.server.round_screen import RoundScreen
from nestling.server.screening import (
    RECENT_ROUNDS,
    FlatUpdate,
    GlobalLayout,
    RobustPolicy,
    UpdateWorkspace,
    absolute_reason,
)
from nestling.server.strategies.base import DeviceInfo, Strategy
from nestling.server.strikes import StrikeRecord
from nestling.server.update_cohort import CONSENSUS_ROUNDS

Pairs = list[tuple[Task, Result]]


class ResultAdmission:
    """Admits and screens a round's results. Owns what that needs across a round (the updates measured on
    arrival, the refused tasks) and across the run (task ids already applied, recent rounds' median update rms),
    and tells the divergence guard which boards were judged and which of them sent non-finite tensors."""

    def __init__(self, strategy: Strategy, robust: RobustPolicy, refusals: RefusalLog) -> None:
        self.strategy = strategy
        self.robust = robust
        self.refusals = refusals
        self.seen_tasks: set[str] = set()  # results admitted in any round: a resent one is a duplicate
        self.seconds = 0.0  # measuring and screening updates: part of the robustness overhead
        self.recent_rms: deque[float] = deque(
            maxlen=RECENT_ROUNDS
        )  # aggregated rounds' median rms, newest last
        self.round_rms: float | None = None  # this round's, once screened
        self.registered: dict[str, DeviceInfo] = {}  # the round's selected boards, as they registered
        self.cohort: list[int] = []  # the sample counts the round's available boards registered
        self.updates: dict[str, FlatUpdate] = {}  # task id -> its flat update, for this round's screening
        self.refused_tasks: set[str] = set()  # this round's tasks whose result arrived and was refused
        self.judged: set[str] = set()  # boards whose result reached validation this round
        self.non_finite: set[str] = set()  # ... and of those, the ones whose tensors were NaN/Inf
        self.workspace = UpdateWorkspace()  # the round's flat updates, in buffers reused across rounds
        self.strikes = StrikeRecord(robust.strike_rounds)  # the cohort screen's verdicts per board
        # This round's cohort-screen verdicts (judged and refused device ids, each submodel cohort's median cosine)
        # and the boards set aside for them; each submodel's recent median cosines, oldest first
        self.cohort_verdicts: dict[str, Any] = {}
        self.consensus: dict[str, list[float]] = {}
        self.aside: dict[str, int] = {}
        self._global_layout: GlobalLayout | None = None

    def new_round(self, available: list[DeviceInfo], selected: list[DeviceInfo], tasks: int) -> None:
        """Forget the last round's results; `tasks` results (about) are expected."""
        self.cohort = [d.num_samples for d in available]
        self.registered = {d.device_id: d for d in selected}
        self.updates, self.judged, self.non_finite = {}, set(), set()
        self.refused_tasks = set()
        self.cohort_verdicts, self.aside = {}, {}
        self.workspace.new_round(tasks)

    def wire_refused(self, device_id: str, reason: str) -> None:
        """The transport refused a board's result before decoding it; non-finite tensors count for the guard."""
        if reason == "non_finite" and device_id in self.registered:
            self.judged.add(device_id)
            self.non_finite.add(device_id)

    def admit(self, round_index: int, by_task: dict[str, Task], result: Result) -> str | None:
        """None when the result may be applied, else the counter naming why not. A refused result still
        answers its task for the quorum; an error in judging it refuses it (one board never stops the round)."""
        try:
            verdict = self._judge(round_index, by_task, result)
        except Exception as exc:
            self.refusals.refuse(round_index, str(result.device_id), "rejected_error", repr(exc)[:200])
            verdict = "rejected_error"
        if verdict and verdict.startswith("rejected_") and result.task_id in by_task:
            self.refused_tasks.add(result.task_id)
        return verdict

    def _judge(self, round_index: int, by_task: dict[str, Task], result: Result) -> str | None:
        if result.round > round_index:
            return "future"
        if result.round != round_index:
            return "stale"
        if result.task_id in self.seen_tasks:
            return "duplicate"
        task = by_task.get(result.task_id)
        if task is None or task.device_id != result.device_id:
            return "unknown_task"
        # Refusals below do not use up the task: a corrected result from the same device is still accepted.
        self.judged.add(result.device_id)
        try:
            self.strategy.validate(task, result)
        except NestlingError as exc:
            if has_non_finite(result.weights):
                self.non_finite.add(result.device_id)
            self.refusals.refuse(round_index, result.device_id, "rejected_invalid", str(exc))
            return "rejected_invalid"
        registered = self.registered.get(result.device_id)
        if registered is not None and result.num_samples > registered.num_samples:
            self.refusals.refuse(
                round_index,
                result.device_id,
                "rejected_num_samples",
                f"claims {result.num_samples} samples, registered {registered.num_samples}",
            )
            return "rejected_num_samples"
        if self.robust.screen_updates:
            if self.robust.max_update_norm is None and self.workspace.packed(task, result):
                # Measured with the round's other packed results in `screen` (a few operations for all of
                # them); a non-finite update is refused there. With an absolute bound, on arrival as below.
                self.seen_tasks.add(result.task_id)
                return None
            measured = time.perf_counter()
            update = self.workspace.flat_update(task, result)
            size = update.size
            self.seconds += time.perf_counter() - measured
            reason = absolute_reason(size, self.robust)
            if reason:
                self.workspace.release(update)
                if not math.isfinite(size.norm):
                    self.non_finite.add(result.device_id)
                self.refusals.refuse(round_index, result.device_id, "rejected_update_norm", reason)
                return "rejected_update_norm"
            self.updates[result.task_id] = update
        self.seen_tasks.add(result.task_id)
        return None

    def screen(self, round_index: int, accepted: Pairs, counters: Counter[str]) -> Pairs:
        """The round's screens, weight bounds and clipping over the admitted results (server/round_screen.py)."""
        started = time.perf_counter()
        screen = RoundScreen(
            self.robust,
            self.refusals,
            self.workspace,
            self.updates,
            self.non_finite,
            max(self.recent_rms) if self.recent_rms else None,
            self._layout,
            self.cohort,
            self.strikes,
            self.consensus,
        )
        accepted, self.round_rms = screen.run(round_index, accepted, counters)
        if screen.judged:
            self.cohort_verdicts = {"judged": screen.judged, "refused": screen.struck}
        if screen.medians:
            self.cohort_verdicts["medians"] = screen.medians
            self._remember_medians(screen.medians)
        self.aside = screen.aside
        self.seconds += time.perf_counter() - started
        return accepted

    def round_applied(self) -> None:
        """The round's aggregation stood: later rounds' screening looks back on its median update rms."""
        if self.round_rms is not None:
            self.recent_rms.append(self.round_rms)

    def restore(self, records: Iterable[dict[str, Any]]) -> None:
        """The look back and each board's cohort-screen record as an uninterrupted run had them, from the metrics
        of the rounds a resume keeps."""
        for record in records:
            rms = record.get("update_rms")
            if record.get("aggregated") and isinstance(rms, (int, float)) and math.isfinite(rms):
                self.recent_rms.append(float(rms))
            verdicts = record.get("cohort_screen") or {}
            if verdicts.get("judged"):
                self.strikes.judge(int(record["round"]), verdicts["judged"], set(verdicts.get("refused", [])))
            medians = verdicts.get("medians")
            if isinstance(medians, dict):
                self._remember_medians(
                    {
                        k: float(v)
                        for k, v in medians.items()
                        if isinstance(v, (int, float)) and math.isfinite(v)
                    }
                )

    def _remember_medians(self, medians: dict[str, float]) -> None:
        """Keep each submodel cohort's latest median cosines, as many as the cohort screen looks back on."""
        for key, value in medians.items():
            kept = self.consensus.setdefault(key, [])
            kept.append(value)
            del kept[: -(CONSENSUS_ROUNDS - 1)]

    def _layout(self) -> GlobalLayout:
        """The global model's flat layout the direction screen compares nested updates in (cached per shapes)."""
        shapes = {k: tuple(v.shape) for k, v in self.strategy.global_state.items() if v.is_floating_point()}
        if self._global_layout is None or self._global_layout.shapes != shapes:
            self._global_layout = GlobalLayout(shapes)
        return self._global_layout


def has_non_finite(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether any floating tensor holds NaN/Inf (False for what is not a tensor dict: validation said why)."""
    try:
        return any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in tensors.values())
    except (TypeError, AttributeError, RuntimeError):
        return False
