"""Progress bars and result tables for long runs (rich)."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from nestling.numbers import headline, percent


class RoundProgress:
    """A round counter with the latest accuracies; silent when disabled (CI logs, --quiet)."""

    def __init__(self, rounds: int, *, enabled: bool = True, title: str = "rounds") -> None:
        self.enabled = enabled
        self.rounds = rounds
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            disable=not enabled,
        )
        self.title = title
        self.task_id: Any = None

    def __enter__(self) -> RoundProgress:
        self.progress.__enter__()
        self.task_id = self.progress.add_task(self.title, total=self.rounds, status="")
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.progress.__exit__(exc_type, exc, traceback)

    def update(self, record: Any) -> None:
        status = ""
        if record.submodels:
            accs = [s["accuracy"] for s in record.submodels]
            status = f"worst {percent(min(accs))}  avg {percent(sum(accs) / len(accs))}"
        elif record.train_loss is not None:
            status = f"loss {record.train_loss:.3f}"
        self.progress.update(self.task_id, completed=record.round + 1, status=status)


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
