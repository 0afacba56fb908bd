"""Progress bars and result tables for long runs (rich)."""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from nestling.numbers import headline, percent


class RoundProgress:
    """A round counter with the latest accuracies and the time left; silent when disabled (--quiet). On a
    terminal it is a live bar; elsewhere (a log file, a pipe, CI) one plain line per round, so a long run
    never goes quiet for minutes."""

    def __init__(self, rounds: int, *, enabled: bool = True, title: str = "rounds") -> None:
        self.enabled = enabled
        self.rounds = rounds
        self.live = enabled and Console().is_terminal
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
            disable=not self.live,
        )
        self.title = title
        self.task_id: Any = None
        self.started = time.monotonic()
        self.done = 0  # rounds finished in this process (a resumed run starts later)

    def __enter__(self) -> RoundProgress:
        self.progress.__enter__()
        self.task_id = self.progress.add_task(self.title, total=self.rounds, status="")
        self.started = time.monotonic()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.progress.__exit__(exc_type, exc, traceback)

    def time_left(self, completed: int) -> str:
        """The rounds left at this process's mean round time so far, as h:mm:ss."""
        per_round = (time.monotonic() - self.started) / max(1, self.done)
        return clock_time(per_round * max(0, self.rounds - completed))

    def update(self, record: Any) -> None:
        self.done += 1
        completed = record.round + 1
        status = ""
        if record.submodels:
            accs = [s["accuracy"] for s in record.submodels]
            status = f"worst {percent(min(accs))}  avg {percent(sum(accs) / len(accs))}"
        elif record.train_loss is not None:
            status = f"loss {record.train_loss:.3f}"
        status = f"{status}  left {self.time_left(completed)}".strip()
        if self.live:
            self.progress.update(self.task_id, completed=completed, status=status)
        elif self.enabled:
            elapsed = clock_time(time.monotonic() - self.started)
            print(f"{self.title}: round {completed}/{self.rounds}  {elapsed} elapsed  {status}", flush=True)


def clock_time(seconds: float) -> str:
    """Seconds as h:mm:ss."""
    whole = round(seconds)
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def print_submodel_table(summary: dict[str, Any], console: Console | None = None) -> None:
    """The per-submodel accuracy table every run ends with."""
    console = console or Console()
    table = Table(
        title=f"{summary['method']} · {summary['model']} · {summary['dataset']} · {summary['rounds']} rounds"
    )
    for column in ("submodel", "id", "accuracy", "loss", "parameters", "MACs"):
        table.add_column(column, justify="right" if column not in ("submodel", "id") else "left")
    for sub in summary["submodels"]:
        table.add_row(
            sub["name"],
            sub["id"],
            percent(sub["accuracy"]),
            f"{sub['loss']:.3f}",
            f"{sub['parameters']:,}",
            f"{sub['macs']:,}",
        )
    console.print(table)
    if summary.get("worst_accuracy") is not None:
        console.print(
            f"{headline(summary)} · "
            f"wall {summary['wall_seconds']:.1f}s  train {summary['train_seconds']:.1f}s"
        )
