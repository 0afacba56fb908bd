"""Round-by-round comparison of a replay and an emulated fleet: selections, arrivals, durations, time-to-accuracy.

Pure functions over the runs' files (metrics.jsonl, the replay's timeline.jsonl, the agents' logs), no torch and
no processes, so tests/benchmarks/test_fidelity.py checks them directly. benchmarks/fidelity.py --mixed uses them.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# A task whose host overran its board by more than this share of the round's predicted length may have
# changed the round (its result arrived later than the board's would have).
OVERRUN_TOLERANCE = 0.05

ABANDONED_LINE = re.compile(r"round (\d+): abandoned \S+ [^:]*: the board left")
LEFT_LINE = re.compile(r"leaving: trace device (\S+) goes offline at trace time ([\d.]+) s")
RETURN_LINE = re.compile(r"returning: trace device (\S+) comes online at trace time ([\d.]+) s")


@dataclass(frozen=True)
class RoundOutcome:
    """One round as one world saw it: who was asked, whose result was used, who left mid-task, when."""

    round: int
    selected: frozenset[str]
    used: frozenset[str]
    dropped: frozenset[str]
    started_s: float  # since the first round's dispatch
    duration_s: float
    accuracy: float | None

    @property
    def closed_s(self) -> float:
        return self.started_s + self.duration_s


def _accuracy(record: Mapping[str, Any]) -> float | None:
    submodels = record.get("submodels") or []
    return max(float(s["accuracy"]) for s in submodels) if submodels else None


def replay_outcomes(
    metrics: Sequence[Mapping[str, Any]], timeline: Sequence[Mapping[str, Any]]
) -> list[RoundOutcome]:
    """The simulator's rounds: metrics.jsonl for times and accuracy, timeline.jsonl for each task's fate."""
    by_round: dict[int, dict[str, set[str]]] = {}
    for row in timeline:
        fates = by_round.setdefault(int(row["round"]), {"selected": set(), "used": set(), "dropped": set()})
        fates["selected"].add(row["device_id"])
        if row["outcome"] in ("used", "dropped"):
            fates[row["outcome"]].add(row["device_id"])
    return _outcomes(metrics, by_round)


def fleet_outcomes(
    metrics: Sequence[Mapping[str, Any]], left_mid_task: Mapping[int, set[str]]
) -> list[RoundOutcome]:
    """The fleet's rounds: metrics.jsonl's plans name the devices sent a task and whether their result was used
    (not censored); `left_mid_task` (from the agents' logs) names those that left holding it."""
    by_round: dict[int, dict[str, set[str]]] = {}
    for record in metrics:
        plans = record.get("plans") or {}
        r = int(record["round"])
        by_round[r] = {
            "selected": set(plans),
            "used": {d for d, plan in plans.items() if not plan.get("censored", False)},
            "dropped": set(left_mid_task.get(r, set())) & set(plans),
        }
    return _outcomes(metrics, by_round)


def _outcomes(
    metrics: Sequence[Mapping[str, Any]], fates: Mapping[int, Mapping[str, set[str]]]
) -> list[RoundOutcome]:
    if not metrics:
        return []
    origin = min(float(r["dispatched_at"]) for r in metrics)
    out = []
    for record in sorted(metrics, key=lambda r: int(r["round"])):
        r = int(record["round"])
        seen = fates.get(r, {})
        out.append(
            RoundOutcome(
                r,
                frozenset(seen.get("selected", ())),
                frozenset(seen.get("used", ())),
                frozenset(seen.get("dropped", ())),
                float(record["dispatched_at"]) - origin,
                float(record["closed_at"]) - float(record["dispatched_at"]),
                _accuracy(record),
            )
        )
    return out


def left_mid_task(agent_logs: Mapping[str, str]) -> dict[int, set[str]]:
    """Round → devices whose agent abandoned that round's task because its board left (their logs)."""
    out: dict[int, set[str]] = {}
    for device, text in agent_logs.items():
        for match in ABANDONED_LINE.finditer(text):
            out.setdefault(int(match.group(1)), set()).add(device)
    return out


def comings_and_goings(text: str) -> list[tuple[str, float]]:
    """An agent's departures and returns, in order: ("left" | "returned", trace time in seconds)."""
    events = [("left", m.start(), float(m.group(2))) for m in LEFT_LINE.finditer(text)]
    events += [("returned", m.start(), float(m.group(2))) for m in RETURN_LINE.finditer(text)]
    return [(kind, t) for kind, _, t in sorted(events, key=lambda e: e[1])]


@dataclass(frozen=True)
class RoundComparison:
    simulated: RoundOutcome
    fleet: RoundOutcome
    overrun_s: float = 0.0  # the largest host overrun of a task that mattered to this round
    host_bound: bool = False  # that overrun may have changed the round

    @property
    def same_selection(self) -> bool:
        """Same devices asked, same results used, same devices lost mid-task."""
        s, f = self.simulated, self.fleet
        return s.selected == f.selected and s.used == f.used and s.dropped == f.dropped

    @property
    def error(self) -> float:
        """The fleet's round length relative to the simulator's prediction."""
        return (self.fleet.duration_s - self.simulated.duration_s) / self.simulated.duration_s


@dataclass
class Verdict:
    rows: list[RoundComparison]
    target_accuracy: float
    tta_simulated_s: float | None
    tta_fleet_s: float | None
    equal_time_s: float
    accuracy_simulated: float | None
    accuracy_fleet: float | None
    notes: list[str] = field(default_factory=list)

    @property
    def tta_error(self) -> float | None:
        if self.tta_simulated_s is None or self.tta_fleet_s is None or self.tta_simulated_s <= 0:
            return None
        return (self.tta_fleet_s - self.tta_simulated_s) / self.tta_simulated_s

    @property
    def host_bound_rounds(self) -> list[int]:
        return [row.simulated.round for row in self.rows if row.host_bound]


def pair_rounds(
    simulated: Sequence[RoundOutcome],
    fleet: Sequence[RoundOutcome],
    overruns: Mapping[int, Mapping[str, float]] | None = None,
) -> list[RoundComparison]:
    """Both worlds' rounds side by side, each with the host overrun that may have changed it.

    An overrun matters when it hit a task whose result was used, or one the simulator used and the fleet did
    not: its result then came later than the board's would have."""
    by_round = {o.round: o for o in fleet}
    missing = sorted({o.round for o in simulated} ^ set(by_round))
    if missing:
        raise ValueError(f"rounds {missing} ran in one world only")
    rows = []
    for sim in simulated:
        if not sim.duration_s > 0:
            raise ValueError(
                f"round {sim.round}: simulated duration {sim.duration_s} s; a replayed round takes time"
            )
        real = by_round[sim.round]
        per_device = (overruns or {}).get(sim.round, {})
        relevant = real.used | (sim.used - real.used)
        worst = max((per_device.get(d, 0.0) for d in relevant), default=0.0)
        rows.append(RoundComparison(sim, real, worst, worst > OVERRUN_TOLERANCE * sim.duration_s))
    return rows


def time_to_accuracy(outcomes: Sequence[RoundOutcome], target: float) -> float | None:
    """Seconds from the first round's dispatch to the close of the first round evaluated at >= target."""
    for o in outcomes:
        if o.accuracy is not None and o.accuracy >= target:
            return o.closed_s
    return None


def accuracy_at(outcomes: Sequence[RoundOutcome], seconds: float) -> float | None:
    """The accuracy of the newest round closed by `seconds` (None before the first evaluation)."""
    reached = [o.accuracy for o in outcomes if o.closed_s <= seconds and o.accuracy is not None]
    return reached[-1] if reached else None


def verdict(
    rows: Sequence[RoundComparison], target_share: float = 0.9, target: float | None = None
) -> Verdict:
    """Time-to-accuracy in both worlds, at `target` (default: `target_share` of the lower of the two worlds'
    best accuracies, so both reach it), and each world's accuracy at the wall time both ran."""
    simulated = [row.simulated for row in rows]
    fleet = [row.fleet for row in rows]
    best = [
        max((o.accuracy for o in world if o.accuracy is not None), default=0.0)
        for world in (simulated, fleet)
    ]
    chosen = target_share * min(best) if target is None else target
    equal = min(simulated[-1].closed_s, fleet[-1].closed_s) if rows else 0.0
    return Verdict(
        list(rows),
        chosen,
        time_to_accuracy(simulated, chosen),
        time_to_accuracy(fleet, chosen),
        equal,
        accuracy_at(simulated, equal),
        accuracy_at(fleet, equal),
    )


def final_line(v: Verdict, classes: int, dropouts: int) -> str:
    """`classes=N dropouts=D median_abs_err=… worst_err=… tta_err=… same_selection=K/R`; the three error
    figures read `host_bound` when the host's overrun may have changed a round (they would measure the host)."""
    same = sum(row.same_selection for row in v.rows)
    head = f"classes={classes} dropouts={dropouts}"
    tail = f"same_selection={same}/{len(v.rows)}"
    if v.host_bound_rounds:
        return f"{head} median_abs_err=host_bound worst_err=host_bound tta_err=host_bound {tail}"
    errors = [abs(row.error) for row in v.rows]
    tta = v.tta_error
    return (
        f"{head} median_abs_err={statistics.median(errors):.3f} worst_err={max(errors):.3f} "
        f"tta_err={'none' if tta is None else f'{abs(tta):.3f}'} {tail}"
    )


def round_table(v: Verdict) -> str:
    """Markdown: each round in both worlds (sizes of the sets; `*` marks a round whose sets differ)."""
    lines = [
        "| round | selected | used sim / fleet | left mid-task sim / fleet | simulated (s) | fleet (s) | error | "
        "acc sim / fleet | host overrun (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in v.rows:
        s, f = row.simulated, row.fleet
        mark = "" if row.same_selection else " *"
        acc = " / ".join("–" if a is None else f"{100 * a:.1f}" for a in (s.accuracy, f.accuracy))
        lines.append(
            f"| {s.round}{mark} | {len(s.selected)} / {len(f.selected)} | {_names(s.used)} / {_names(f.used)} | "
            f"{_names(s.dropped)} / {_names(f.dropped)} | {s.duration_s:.3f} | {f.duration_s:.3f} | "
            f"{row.error:+.3f} | {acc} | {row.overrun_s:.3f}{' (host-bound)' if row.host_bound else ''} |"
        )
    return "\n".join(lines)


def _names(devices: frozenset[str]) -> str:
    return ",".join(sorted(d.rsplit("-", 1)[-1].lstrip("0") or "0" for d in devices)) or "–"
