"""The one round loop: select → assign → dispatch → collect (quorum/deadline) → aggregate → evaluate → checkpoint.

Clock- and transport-agnostic: the simulator drives it with an in-process transport and a virtual
clock, a fleet with MQTT and the wall clock. No other round loop exists in Nestling.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from nestling.aggregation import robust_rule
from nestling.errors import NestlingError
from nestling.messages import Result, Task
from nestling.server.board_guard import (
    ASSIGN_REFUSED,
    assign_guarded,
    local_train_seconds,
    mean_train_loss,
    observed_seconds,
)
from nestling.server.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    load_checkpoint_side,
    save_strategy_checkpoint,
)
from nestling.server.clock import Clock
from nestling.server.evaluation import EvalResult, Evaluator
from nestling.server.refusals import RefusalLog
from nestling.server.round_screen import RoundScreen
from nestling.server.screening import (
    RECENT_ROUNDS,
    FlatUpdate,
    GlobalLayout,
    RobustPolicy,
    UpdateWorkspace,
    absolute_reason,
    largest_magnitude,
)
from nestling.server.strategies.base import DeviceInfo, Strategy
from nestling.server.transport import Transport
from nestling.strict_json import strict_dumps

log = logging.getLogger("nestling.coordinator")


@dataclass
class RoundPolicy:
    """How rounds are run: participation, over-selection, quorum, deadline, evaluation and checkpoints."""

    rounds: int
    fraction: float = 0.1
    over_selection: float = 1.0  # fleets use 1.3: dispatch to 30% more devices than the round needs
    quorum: float = 1.0  # fraction of the needed results below which a round is abandoned
    deadline_s: float | None = None
    eval_every: int = 1
    checkpoint_every: int = 1
    seed: int = 0
    robust: RobustPolicy = field(default_factory=RobustPolicy)


@dataclass
class RoundRecord:
    round: int
    wall_seconds: float
    collect_seconds: float
    virtual_time: float
    selected: int
    accepted: int
    aggregated: bool
    bytes_down: int
    bytes_up: int
    local_train_seconds: float = 0.0  # Σ of the training time devices reported (compute-seconds, all workers)
    counters: dict[str, int] = field(default_factory=dict)
    submodels: list[dict[str, Any]] = field(default_factory=list)
    train_loss: float | None = None
    # Clock readings (virtual seconds in a replay, monotonic wall seconds on a fleet) when the round's tasks
    # started going out and when the round closed: closed_at - dispatched_at is the round's duration on the
    # devices' side, without the server's selection, aggregation, evaluation and checkpoint around it.
    dispatched_at: float = 0.0
    closed_at: float = 0.0
    # Divergence guard: the round whose aggregation was undone (this one or the previous) and the devices
    # whose updates it applied, now skipped for [run] quarantine_rounds rounds.
    rolled_back: int | None = None
    quarantined: list[str] = field(default_factory=list)
    method: dict[str, Any] = field(
        default_factory=dict
    )  # what the strategy reports of the round (round_report)
    # Profiled boards (profiler/fit.py): each one's spec, why, predicted and observed local training time and
    # speed factor; and the boards whose sizing changed this round. Left out of metrics.jsonl when empty.
    plans: dict[str, dict[str, Any]] = field(default_factory=dict)
    replans: list[dict[str, Any]] = field(default_factory=list)
    # Median rms of the round's screened updates (trained weights): what later rounds' screening looks back
    # on (server/screening.py `outliers`). Left out of metrics.jsonl when the round screened nothing.
    update_rms: float | None = None


def tensor_bytes(tensors: dict) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors.values()))


class SideState(Protocol):
    """State outside the strategy that a checkpoint must carry for a resumed run to match an uninterrupted
    one: the simulator's per-device stores (on a real fleet they stay on the boards)."""

    name: str

    def snapshot(self) -> dict[str, torch.Tensor]: ...

    def restore(self, tensors: dict[str, torch.Tensor]) -> None: ...


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
        self.evaluator = evaluator
        self.policy = policy
        self.out_dir = out_dir
        self.on_round = on_round
        self.side = side
        self.start_round = 0
        self.totals: Counter[str] = Counter()
        self.last_eval: list[EvalResult] = []
        self.seen_tasks: set[str] = set()
        self.refusals = RefusalLog(log)
        self.quarantine: dict[str, int] = {}  # device -> first round it may be selected again
        self.quarantine_log: list[dict[str, Any]] = []  # every quarantine, for the run's summary
        self.aggregate_seconds = 0.0  # screening + aggregation + divergence guard, the robustness overhead
        self._registered: dict[str, DeviceInfo] = {}
        self._cohort: list[int] = []  # the sample counts the round's available devices registered
        self._updates: dict[str, FlatUpdate] = {}  # task id -> its flat update, for this round's screening
        self._refused_tasks: set[str] = set()  # this round's tasks whose result arrived and was refused
        self._global_layout: GlobalLayout | None = None
        self._workspace = UpdateWorkspace()  # the round's flat updates, in buffers reused across rounds
        self._judged: set[str] = set()  # devices whose result reached validation this round
        self._non_finite: set[str] = set()  # ... and of those, the ones whose tensors were NaN/Inf
        # Divergence guard: the strategy's state before the last applied aggregation, and who it applied.
        self._before_last: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None
        self._last_applied: tuple[int, list[str]] | None = None
        self._scale: float | None = None  # largest |w| of the global model after the last aggregation
        self._recent_rms: deque[float] = deque(maxlen=RECENT_ROUNDS)  # rounds' median update rms, newest last
        self._round_rms: float | None = None  # this round's, once screened

    # -- selection ------------------------------------------------------------------------------
    def needed(self) -> int:
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
        started = time.perf_counter()
        counters: Counter[str] = Counter()
        available = [
            d for d in self.transport.devices() if self.quarantine.get(d.device_id, -1) <= round_index
        ]
        selected = self.select(round_index, available)
        self._cohort = [d.num_samples for d in available]
        self._registered = {d.device_id: d for d in selected}
        self._updates, self._judged, self._non_finite = {}, set(), set()
        self._refused_tasks = set()

        def refuse_assignment(device_id: str, detail: str) -> None:
            counters[ASSIGN_REFUSED] += 1
            self.refusals.refuse(round_index, device_id, ASSIGN_REFUSED, detail)

        tasks = assign_guarded(self.strategy, round_index, selected, refuse_assignment)
        self._workspace.new_round(len(tasks))
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
        received = len(accepted) + len(self._refused_tasks - {result.task_id for _, result in accepted})
        screen_started = time.perf_counter()
        accepted = self._screen_round(round_index, accepted, counters)
        self.aggregate_seconds += time.perf_counter() - screen_started
        closed_at = self.clock.now()
        self.transport.cancel(round_index)
        self.refusals.flush()
        rolled_back, quarantined = self._guard_previous_round(round_index, counters)
        if rolled_back is not None:  # these results were trained from the model just undone
            counters["discarded_after_rollback"] += len(accepted)
            accepted = []
        quorum = max(1, math.ceil(self.policy.quorum * min(self.needed(), len(tasks))))
        aggregated = received >= quorum and bool(accepted)
        if aggregated:
            aggregate_started = time.perf_counter()
            aggregated = self._aggregate_guarded(round_index, accepted, counters)
            self.aggregate_seconds += time.perf_counter() - aggregate_started
            if aggregated and self._round_rms is not None:
                self._recent_rms.append(self._round_rms)
            if not aggregated:
                rolled_back, quarantined = round_index, self._quarantine(round_index, accepted)
        elif received < quorum:
            counters["rounds_below_quorum"] += 1
            log.warning(
                "round %d: %d results < quorum %d; global model unchanged", round_index, received, quorum
            )
        elif rolled_back is None:
            counters["rounds_all_refused"] += 1
            log.warning("round %d: every result was refused; global model unchanged", round_index)
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
            quarantined=quarantined,
            method=self.strategy.round_report(round_index, accepted if aggregated else []),
            plans=plans,
            replans=replans,
            update_rms=self._round_rms,
        )
        if self._is_eval_round(round_index):
            self.last_eval = (
                self.evaluator.evaluate_all(self.strategy.eval_targets()) if self.evaluator else []
            )
            record.submodels = [asdict(e) for e in self.last_eval]
        record.wall_seconds = time.perf_counter() - started
        self.totals.update(counters)
        self._persist(round_index, record)
        if self.on_round:
            self.on_round(record)
        return record

    def _collect(
        self, round_index: int, tasks: dict[str, Task], counters: Counter[str]
    ) -> tuple[list[tuple[Task, Result]], float]:
        want = min(self.needed(), len(tasks))
        deadline = self.clock.now() + (
            self.policy.deadline_s if self.policy.deadline_s is not None else math.inf
        )
        by_task = {t.task_id: t for t in tasks.values()}
        accepted: list[tuple[Task, Result]] = []
        spent = 0.0
        while len(accepted) < want and self.clock.now() < deadline:
            t0 = time.perf_counter()
            delivery = self.transport.wait(deadline, want - len(accepted))
            spent += time.perf_counter() - t0
            counters["dropouts"] += len(delivery.dropped)
            for device_id, reason in delivery.rejected:
                counters[f"rejected_{reason}"] += 1
                if reason == "non_finite" and device_id in self._registered:  # refused at the wire already
                    self._judged.add(device_id)
                    self._non_finite.add(device_id)
            for result in delivery.results:
                try:
                    verdict = self._admit(round_index, by_task, result)
                except Exception as exc:  # one device's result must never stop the round
                    self.refusals.refuse(
                        round_index, str(result.device_id), "rejected_error", repr(exc)[:200]
                    )
                    verdict = "rejected_error"
                if verdict:
                    counters[verdict] += 1
                    if verdict.startswith("rejected_") and result.task_id in by_task:
                        self._refused_tasks.add(result.task_id)
                    if verdict.startswith("rejected_") and hasattr(self.transport, "reopen"):
                        self.transport.reopen(result.task_id)  # a corrected result is still welcome
                    continue
                if len(accepted) >= want:
                    counters["late"] += 1
                    continue
                accepted.append((by_task[result.task_id], result))
            # A refused result is its board's answer: once every board answered, the round closes at once.
            answered = self._refused_tasks | {result.task_id for _, result in accepted}
            if answered >= set(by_task) or (not delivery.results and self.transport.idle()):
                break
        return accepted, spent

    def _admit(self, round_index: int, by_task: dict[str, Task], result: Result) -> str | None:
        """None when the result may be applied, else the counter naming why it was refused."""
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
        self._judged.add(result.device_id)
        try:
            self.strategy.validate(task, result)
        except NestlingError as exc:
            if _has_non_finite(result.weights):
                self._non_finite.add(result.device_id)
            self.refusals.refuse(round_index, result.device_id, "rejected_invalid", str(exc))
            return "rejected_invalid"
        registered = self._registered.get(result.device_id)
        if registered is not None and result.num_samples > registered.num_samples:
            self.refusals.refuse(
                round_index,
                result.device_id,
                "rejected_num_samples",
                f"claims {result.num_samples} samples, registered {registered.num_samples}",
            )
            return "rejected_num_samples"
        if self.policy.robust.screen_updates:
            if self.policy.robust.max_update_norm is None and self._workspace.packed(task, result):
                # Measured with the round's other packed results in `_screen_round` (a few operations for all
                # of them); a non-finite update is refused there. With an absolute bound, on arrival as below.
                self.seen_tasks.add(result.task_id)
                return None
            measured = time.perf_counter()
            update = self._workspace.flat_update(task, result)
            size = update.size
            self.aggregate_seconds += time.perf_counter() - measured
            reason = absolute_reason(size, self.policy.robust)
            if reason:
                self._workspace.release(update)
                if not math.isfinite(size.norm):
                    self._non_finite.add(result.device_id)
                self.refusals.refuse(round_index, result.device_id, "rejected_update_norm", reason)
                return "rejected_update_norm"
            self._updates[result.task_id] = update
        self.seen_tasks.add(result.task_id)
        return None

    def _screen_round(
        self, round_index: int, accepted: list[tuple[Task, Result]], counters: Counter[str]
    ) -> list[tuple[Task, Result]]:
        """The round's screens, weight bounds and clipping (server/round_screen.py)."""
        screen = RoundScreen(
            self.policy.robust,
            self.refusals,
            self._workspace,
            self._updates,
            self._non_finite,
            max(self._recent_rms) if self._recent_rms else None,
            self._layout,
            self._cohort,
        )
        accepted, self._round_rms = screen.run(round_index, accepted, counters)
        return accepted

    def _layout(self) -> GlobalLayout:
        """The global model's flat layout the direction screen compares nested updates in (cached per shapes)."""
        shapes = {k: tuple(v.shape) for k, v in self.strategy.global_state.items() if v.is_floating_point()}
        if self._global_layout is None or self._global_layout.shapes != shapes:
            self._global_layout = GlobalLayout(shapes)
        return self._global_layout

    # -- divergence guard ------------------------------------------------------------------------
    def _snapshot(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The strategy's state before a round, by reference: `Strategy.aggregate` replaces state tensors and
        never writes into them (tests/server/strategies/test_state_contract.py holds every method to it), so
        no copy is needed; `load_state` copies when rolling back."""
        meta = self.strategy.state_meta()
        return dict(self.strategy.state_tensors()), json.loads(json.dumps(meta)) if meta else {}

    def _aggregate_guarded(
        self, round_index: int, accepted: list[tuple[Task, Result]], counters: Counter[str]
    ) -> bool:
        """Aggregate; undo it (False) when it failed or left the model non-finite or exploded."""
        robust = self.policy.robust
        before = self._snapshot() if robust.divergence_guard else None
        scale_before = 0.0
        if before is not None:
            scale_before = (
                self._scale if self._scale is not None else largest_magnitude(self.strategy.global_state)
            )
        try:
            with robust_rule(robust.aggregation, robust.trim_fraction):
                self.strategy.aggregate(round_index, accepted)
        except Exception as exc:  # a result that slipped past validation must not stop the run
            if before is None:
                raise
            log.error("round %d: aggregation failed (%r); global model rolled back", round_index, exc)
            counters["aggregation_failed"] += 1
            self.strategy.load_state(*before)
            return False
        if before is None:
            return True
        scale_after = largest_magnitude(self.strategy.global_state)
        if not math.isfinite(scale_after) or scale_after > robust.divergence_factor * max(scale_before, 1.0):
            log.error(
                "round %d: global model diverged (largest |w| %.3g -> %.3g); rolled back to the state "
                "before the round",
                round_index,
                scale_before,
                scale_after,
            )
            counters["rolled_back"] += 1
            self.strategy.load_state(*before)
            self._scale = scale_before
            return False
        self._before_last, self._scale = before, scale_after
        self._last_applied = (round_index, [r.device_id for _, r in accepted])
        return True

    def _guard_previous_round(self, round_index: int, counters: Counter[str]) -> tuple[int | None, list[str]]:
        """Most of this round's results non-finite: the previous aggregation poisoned the model; undo it."""
        if (
            self._before_last is None
            or self._last_applied is None
            or self._last_applied[0] != round_index - 1
        ):
            return None, []
        if not self._non_finite or len(self._non_finite) * 2 <= len(self._judged):
            return None, []
        previous, devices = self._last_applied
        log.error(
            "round %d: most results are non-finite; rolling back round %d and quarantining %s",
            round_index,
            previous,
            ", ".join(devices),
        )
        counters["rolled_back"] += 1
        self.strategy.load_state(*self._before_last)
        self._before_last = self._last_applied = self._scale = None
        return previous, self._quarantine(round_index, [], devices)

    def _quarantine(
        self, round_index: int, accepted: list[tuple[Task, Result]], devices: list[str] | None = None
    ) -> list[str]:
        names = sorted(devices if devices is not None else {r.device_id for _, r in accepted})
        until = round_index + 1 + self.policy.robust.quarantine_rounds
        for name in names:
            self.quarantine[name] = until
        if names:
            self.quarantine_log.append({"round": round_index, "devices": names, "until_round": until})
        return names

    def _is_eval_round(self, round_index: int) -> bool:
        last = round_index == self.policy.rounds - 1
        return last or (self.policy.eval_every > 0 and (round_index + 1) % self.policy.eval_every == 0)

    # -- persistence -----------------------------------------------------------------------------
    def _persist(self, round_index: int, record: RoundRecord) -> None:
        if self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        line = asdict(record)
        for key in ("plans", "replans"):  # runs without profiled boards keep their metrics as they were
            if not line[key]:
                del line[key]
        if line["update_rms"] is None:
            del line["update_rms"]
        with (self.out_dir / "metrics.jsonl").open("a") as fh:
            fh.write(strict_dumps(line) + "\n")
        last = round_index == self.policy.rounds - 1
        if last or (
            self.policy.checkpoint_every > 0 and (round_index + 1) % self.policy.checkpoint_every == 0
        ):
            save_strategy_checkpoint(
                self.out_dir / "checkpoints",
                round_index,
                self.strategy,
                seed=self.policy.seed,
                totals=self.totals,
                sides={self.side.name: self.side.snapshot()} if self.side else None,
            )

    def resume(self) -> int:
        """Continue after the newest complete checkpoint; metrics of later, unfinished rounds are dropped."""
        if self.out_dir is None:
            raise NestlingError("--resume needs an output directory")
        path = latest_checkpoint(self.out_dir / "checkpoints")
        if path is None:
            raise NestlingError(f"no complete checkpoint under {self.out_dir / 'checkpoints'}")
        tensors, manifest = load_checkpoint(path)
        if manifest.get("method") != self.strategy.name:
            raise NestlingError(
                f"checkpoint is for method '{manifest.get('method')}', not '{self.strategy.name}'"
            )
        self.strategy.load_state(tensors, manifest.get("strategy", {}))
        self.strategy.load_planning_state(manifest.get("planning") or {})
        if self.side:
            self.side.restore(load_checkpoint_side(path, self.side.name) or {})
        self.totals.update(manifest.get("totals", {}))
        self.start_round = int(manifest["round"]) + 1
        metrics = self.out_dir / "metrics.jsonl"
        if metrics.exists():
            kept = [
                line
                for line in metrics.read_text().splitlines()
                if line.strip() and json.loads(line)["round"] < self.start_round
            ]
            metrics.write_text("".join(line + "\n" for line in kept))
            for (
                line
            ) in kept:  # the screening's look back, as the uninterrupted run had it (aggregated rounds)
                record = json.loads(line)
                rms = record.get("update_rms")
                if record.get("aggregated") and isinstance(rms, (int, float)) and math.isfinite(rms):
                    self._recent_rms.append(float(rms))
        return self.start_round

    def run(self) -> list[RoundRecord]:
        return [self.run_round(r) for r in range(self.start_round, self.policy.rounds)]


def _has_non_finite(tensors: dict[str, torch.Tensor]) -> bool:
    try:
        return any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in tensors.values())
    except (TypeError, AttributeError, RuntimeError):
        return False
