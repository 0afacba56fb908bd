"""What the planner did over a run, per board: summary.json's `plans` and `replans`, and the table people read.

metrics.jsonl records each round's plan of every profiled board (`plans`: spec, reason, predicted and observed
training time, speed factor) and its re-plans; the run's summary condenses them per board, so one file says
which submodel each board ended on, why, and how far the predictions were from what the boards did.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from nestling.numbers import mebibytes, seconds

# The last plan's fields a board's summary keeps as they were recorded.
_LAST = ("spec", "reason", "predicted_s", "memory_bytes", "budget_bytes", "time_budget_s", "source")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise_plans(records: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's `plans` (per board: its last plan, every spec it trained in order, median predicted and
    observed seconds, median relative error of the prediction, deadline misses, re-plans, last speed factor)
    and `replans` (each with its round); empty when no board was planned from a profile."""
    boards: dict[str, dict[str, Any]] = {}
    history: dict[str, list[dict[str, Any]]] = {}
    replans: list[dict[str, Any]] = []
    for record in records:
        for device, plan in (record.get("plans") or {}).items():
            history.setdefault(device, []).append(plan)
        replans.extend({"round": record["round"], **r} for r in record.get("replans") or [])
    for device, plans in sorted(history.items()):
        last = plans[-1]
        timed = [p for p in plans if p.get("observed_s") is not None and not p.get("censored")]
        errors = [
            abs(p["observed_s"] - p["predicted_s"]) / p["predicted_s"] for p in timed if p.get("predicted_s")
        ]
        specs: list[str] = []
        for plan in plans:
            if plan["spec"] not in specs:
                specs.append(plan["spec"])
        boards[device] = {
            **{key: last.get(key) for key in _LAST},
            "rounds": len(plans),
            "specs": specs,
            "predicted_s_median": _median([float(p["predicted_s"]) for p in plans]),
            "observed_s_median": _median([float(p["observed_s"]) for p in timed]),
            "time_error_median": _median(errors),
            "missed": sum(1 for p in plans if p.get("censored")),
            "replans": sum(1 for r in replans if r["device"] == device),
            "speed": last.get("speed_after", last.get("speed")),
        }
    return {"plans": boards, "replans": replans} if boards else {}


def print_plan_table(
    summary: Mapping[str, Any], console: Console | None = None, labels: Mapping[str, str] | None = None
) -> None:
    """Per profiled board: the submodel it ended on (and those it trained before), why, the memory it needs
    against its budget, the training time allowed by the round's deadline, median predicted and observed
    training seconds, and its re-plans. Prints nothing for a run without profiled boards."""
    plans = summary.get("plans") or {}
    if not plans:
        return
    names = {s["id"]: s["name"] for s in summary.get("submodels", [])}
    table = Table(
        title="What each board was planned to train, from the profile it reported",
        box=box.SIMPLE,
        pad_edge=False,
        collapse_padding=True,
    )
    for column in ("board", *(["class"] if labels else []), "submodel", "reason"):
        table.add_column(column)
    # memory: the plan's estimate / the board's budget; allowed s: the deadline's training share; then medians
    # over the rounds the board was planned
    for column in ("MiB / budget", "allowed s", "pred. s", "obs. s", "re-plans"):
        table.add_column(column, justify="right")
    for device, board in plans.items():
        earlier = [names.get(s, s[:8]) for s in board["specs"] if s != board["spec"]]
        trained = names.get(board["spec"], board["spec"][:8])
        table.add_row(
            device,
            *([labels.get(device, "?")] if labels else []),
            trained + (f" (was {', '.join(earlier)})" if earlier else ""),
            str(board["reason"]),
            f"{mebibytes(board.get('memory_bytes'))} / {mebibytes(board.get('budget_bytes'))}",
            seconds(board.get("time_budget_s")),
            seconds(board["predicted_s_median"]),
            seconds(board["observed_s_median"]),
            str(board["replans"]),
        )
    (console or Console()).print(table)


__all__ = ["print_plan_table", "summarise_plans"]
