"""What a method adds to a run's record beyond the common one: a per-round report, an end-of-run summary, plots.

Optional: the defaults add nothing; DynamicFL and FedTrans override them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nestling.messages import Result, Task


class MethodReports:
    """A method's own record: metrics.jsonl's `method` field, summary.json's `method_report`, its plots."""

    def round_report(self, round_index: int, accepted: list[tuple[Task, Result]]) -> dict[str, Any]:
        """What this method did in a round beyond the common record (metrics.jsonl's `method` field): DynamicFL's
        expanded convs per capacity, FedTrans's model births. `accepted` are the results it aggregated."""
        return {}

    def run_summary(self) -> dict[str, Any]:
        """What this method adds to summary.json under `method_report` at the end of a run."""
        return {}

    @classmethod
    def describe_trained(cls, method_report: dict[str, Any]) -> str:
        """One line on what the boards trained beyond the task's model, read back from a finished run's
        `method_report` (a reproduction's table prints it: DynamicFL's expanded convs). Empty: nothing to add."""
        return ""

    def write_plots(self, out_dir: Path, summary: dict[str, Any]) -> list[Path]:
        """Plots of this method's own beside accuracy.png (FedTrans: the family's growth); the files written."""
        return []
