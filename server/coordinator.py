"""The one round loop: select → assign → dispatch → collect (quorum/deadline) → aggregate → evaluate → checkpoint.

Clock- and transport-agnostic: the simulator drives it with an in-process transport and a virtual
clock, a fleet with MQTT and the wall clock. No other round loop exists in Nestling. The loop composes
single-job parts: `ResultAdmission` (results admitted on arrival, screened when the round closes),
`DivergenceGuard` (aggregation with rollback and quarantine) and `RunRecorder` (evaluation, metrics,
checkpoints, resume).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from nestling.messages import Result, Task
from nestling.server.board_guard import (
    ASSIGN_REFUSED,
    assign_guarded,
    local_train_seconds,
    mean_train_loss,
    observed_seconds,
)
from nestling.server.clock import Clock
from nestling.server.divergence_guard import DivergenceGuard
from nestling.server.evaluation import EvalResult, Evaluator
from nestling.server.refusals import RefusalLog
from nestling.server.result_admission import ResultAdmission
from nestling.server.rounds import RoundPolicy, RoundRecord, tensor_bytes
from nestling.server.run_recorder import RunRecorder, SideState
from nestling.server.strategies.base import DeviceInfo, Strategy
from nestling.server.transport import Transport

__all__ = ["Coordinator", "RoundPolicy", "RoundRecord", "SideState", "tensor_bytes"]

log = logging.getLogger("nestling.coordinator")

Pairs = list[tuple[Task, Result]]


class Coordinator:
    """Drives a Strategy through rounds over any Transport, reading any Clock."""

    def __init__(
        self,
        strategy: Strategy,
        transport: Transport,
        clock: Clock,
        evaluator: Evaluator | None,
        policy: RoundPolicy,
        out_dir: Path | None = None,
        on_round: Callable[[RoundRecord], None] | None = None,
        side: SideState | None = None,
    ) -> None:
        self.strategy = strategy
        self.transport = transport
        self.clock = clock
        self.policy = policy
        self.on_round = on_round
        self.start_round = 0
        self.refusals = RefusalLog(log)
        self.admission = ResultAdmission(strategy, policy.robust, self.refusals)
        self.guard = DivergenceGuard(strategy, policy.robust)
        self.recorder = RunRecorder(strategy, evaluator, policy, out_dir, side)

    # -- what the run's callers read -------------------------------------------------------------
    @property
    def totals(self) -> Counter[str]:
        """Every round's counters summed (a resumed run starts from its checkpoint's)."""
        return self.recorder.totals

    @property
    def last_eval(self) -> list[EvalResult]:
        return self.recorder.last_eval

    @property
    def quarantine(self) -> dict[str, int]:
        """Device -> first round it may be selected again."""
        return self.guard.quarantine

    @property
    def quarantine_log(self) -> list[dict[str, Any]]:
        return self.guard.quarantine_log

    @property
    def aggregate_seconds(self) -> float:
        """Screening + aggregation + divergence guard: the robustness overhead."""
        return self.admission.seconds + self.guard.seconds

    # -- selection ------------------------------------------------------------------------------
    def needed(self) -> int:
        """Results a round wants: the policy's fraction of the fleet, at least one."""
        return max(1, math.floor(self.policy.fraction * self.strategy.ctx.num_clients))

    def select(self, round_index: int, available: list[DeviceInfo]) -> list[DeviceInfo]:
        """Uniform without replacement, seeded by (seed, round) so a resumed run picks the same devices."""
        pool = sorted(available, key=lambda d: d.device_id)
        count = min(len(pool), math.ceil(self.needed() * self.policy.over_selection))
        rng = np.random.default_rng([self.policy.seed, round_index, 0x5E1EC7])
        picked: list[int] = rng.choice(len(pool), size=count, replace=False).tolist() if count else []
        return [pool[i] for i in sorted(int(p) for p in picked)]

    # -- one round -------------------------------------------------------------------------------
    def run_round(self, round_index: int) -> RoundRecord:
        """Select, assign, dispatch, collect, screen, aggregate under the guard, evaluate and record a round."""
        started = time.perf_counter()
        counters: Counter[str] = Counter()
        available = self.guard.available(self.transport.devices(), round_index)
        selected = self.select(round_index, available)

        def refuse_assignment(device_id: str, detail: str) -> None:
            counters[ASSIGN_REFUSED] += 1
            self.refusals.refuse(round_index, device_id, ASSIGN_REFUSED, detail)

        tasks = assign_guarded(self.strategy, round_index, selected, refuse_assignment)
        self.admission.new_round(available, selected, len(tasks))
        plans, replans = self.strategy.plan_report(round_index, selected, tasks)
        dispatched_at = self.clock.now()
        self.transport.dispatch(list(tasks.values()))
        accepted, collect_seconds = self._collect(round_index, tasks, counters)
        if plans:
            self.strategy.observe_training(
                plans, observed_seconds(plans, accepted, self.clock.now() - dispatched_at)
            )
        # The quorum counts the round's tasks whose result arrived, accepted or refused: a refused update (an
        # attacker's, or an honest outlier's) must not cost the round the results that were accepted.
        received = len(accepted) + len(
            self.admission.refused_tasks - {result.task_id for _, result in accepted}
        )
        accepted = self.admission.screen(round_index, accepted, counters)
        struck = self._set_aside(round_index, counters)
        closed_at = self.clock.now()
        self.transport.cancel(round_index)
        self.refusals.flush()
        quorum = max(1, math.ceil(self.policy.quorum * min(self.needed(), len(tasks))))
        accepted, aggregated, rolled_back, quarantined = self._apply(
            round_index, accepted, received, quorum, counters
        )
        aside = sorted({*quarantined, *struck})  # rolled back or struck: not selected for a while
        record = RoundRecord(
            round=round_index,
            wall_seconds=0.0,
            collect_seconds=collect_seconds,
            virtual_time=self.clock.now(),
            selected=len(selected),
            accepted=len(accepted),
            aggregated=aggregated,
            bytes_down=sum(tensor_bytes(t.weights) for t in tasks.values()),
            bytes_up=sum(tensor_bytes(r.weights) for _, r in accepted),
            counters=dict(counters),
            local_train_seconds=local_train_seconds(accepted),
            train_loss=mean_train_loss(accepted),
            dispatched_at=dispatched_at,
            closed_at=closed_at,
            rolled_back=rolled_back,
            quarantined=aside,
            cohort_screen=self.admission.cohort_verdicts,
            set_aside={d: self.guard.quarantine[d] for d in aside},
            method=self.strategy.round_report(round_index, accepted if aggregated else []),
            plans=plans,
            replans=replans,
            update_rms=self.admission.round_rms,
        )
        self.recorder.evaluate(round_index, record)
        record.wall_seconds = time.perf_counter() - started
        self.recorder.record(round_index, record, counters)
        if self.on_round:
            self.on_round(record)
        return record

    def _collect(
        self, round_index: int, tasks: dict[str, Task], counters: Counter[str]
    ) -> tuple[Pairs, float]:
        """Results until the round has what it needs, every board answered, or the deadline passed."""
        want = min(self.needed(), len(tasks))
        deadline = self.clock.now() + (
            self.policy.deadline_s if self.policy.deadline_s is not None else math.inf
        )
        by_task = {t.task_id: t for t in tasks.values()}
        accepted: Pairs = []
        spent = 0.0
        while len(accepted) < want and self.clock.now() < deadline:
            t0 = time.perf_counter()
            delivery = self.transport.wait(deadline, want - len(accepted))
            spent += time.perf_counter() - t0
            counters["dropouts"] += len(delivery.dropped)
            for device_id, reason in delivery.rejected:
                counters[f"rejected_{reason}"] += 1
                self.admission.wire_refused(device_id, reason)
            for result in delivery.results:
                verdict = self.admission.admit(round_index, by_task, result)
                if verdict:
                    counters[verdict] += 1
                    if verdict.startswith("rejected_") and hasattr(self.transport, "reopen"):
                        self.transport.reopen(result.task_id)  # a corrected result is still welcome
                    continue
                if len(accepted) >= want:
                    counters["late"] += 1
                    continue
                accepted.append((by_task[result.task_id], result))
            # A refused result is its board's answer: once every board answered, the round closes at once.
            answered = self.admission.refused_tasks | {result.task_id for _, result in accepted}
            if answered >= set(by_task) or (not delivery.results and self.transport.idle()):
                break
        return accepted, spent

    def _set_aside(self, round_index: int, counters: Counter[str]) -> list[str]:
        """Boards the cohort screen refused in 2 of their last 3 judged rounds are not selected for a while
        (server/strikes.py); their names."""
        aside = self.admission.aside
        for device, first in sorted(aside.items()):
            counters["set_aside_by_strikes"] += 1
            log.warning(
                "round %d: %s was refused by the cohort screen in 2 of its last 3 judged rounds; "
                "not selected before round %d",
                round_index,
                device,
                first,
            )
        return self.guard.set_aside(round_index, aside, "refused by the cohort screen") if aside else []

    def _apply(
        self, round_index: int, accepted: Pairs, received: int, quorum: int, counters: Counter[str]
    ) -> tuple[Pairs, bool, int | None, list[str]]:
        """Aggregate the screened results under the guard when the quorum answered. Returns the results that
        count as the round's, whether they were applied, the round rolled back (if any) and who was quarantined."""
        admission = self.admission
        rolled_back, quarantined = self.guard.undo_previous(
            round_index, admission.non_finite, admission.judged, counters
        )
        if rolled_back is not None:  # these results were trained from the model just undone
            counters["discarded_after_rollback"] += len(accepted)
            accepted = []
        aggregated = received >= quorum and bool(accepted)
        if aggregated:
            aggregated = self.guard.aggregate(round_index, accepted, counters)
            if aggregated:
                admission.round_applied()
            else:
                rolled_back = round_index
                quarantined = self.guard.quarantine_devices(round_index, {r.device_id for _, r in accepted})
        elif received < quorum:
            counters["rounds_below_quorum"] += 1
            log.warning(
                "round %d: %d results < quorum %d; global model unchanged", round_index, received, quorum
            )
        elif rolled_back is None:
            counters["rounds_all_refused"] += 1
            log.warning("round %d: every result was refused; global model unchanged", round_index)
        return accepted, aggregated, rolled_back, quarantined

    # -- a whole run ----------------------------------------------------------------------------------
    def resume(self) -> int:
        """Continue after the newest complete checkpoint; metrics of later, unfinished rounds are dropped."""
        self.start_round, kept = self.recorder.resume()
        self.admission.restore(kept)  # the screening's look back, as the uninterrupted run had it
        self.guard.restore(kept)  # and who was set aside until when
        return self.start_round

    def run(self) -> list[RoundRecord]:
        """Every round from `start_round` (0, or after the checkpoint resumed from) to the policy's last."""
        return [self.run_round(r) for r in range(self.start_round, self.policy.rounds)]
