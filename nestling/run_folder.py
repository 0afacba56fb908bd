"""A run folder's life: refused when it already holds a run, claimed only once the run starts, and a
finished run left exactly as it is. `nestling simulate` and `nestling server` both go through here, so a
typo, a failed start or a wrong `--out` never deletes, rewrites or mixes a run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from nestling.checkpoint_io import latest_checkpoint
from nestling.errors import ConfigError

# Everything a run writes into its folder; `--overwrite` removes these and nothing else.
RUN_ARTIFACTS = (
    "config.toml",
    "run.json",
    "registry.json",
    "metrics.jsonl",
    "timeline.jsonl",
    "summary.json",
    "accuracy.png",
    "growth.png",
    "checkpoints",
    "report",
)


def run_artifacts(out_dir: Path) -> list[str]:
    """The run files already in `out_dir` (empty when there is no run there)."""
    return [name for name in RUN_ARTIFACTS if (out_dir / name).exists()]


def refuse_existing_run(out_dir: Path, *, overwrite: bool) -> None:
    """Raise before any work when `out_dir` holds a run and `--overwrite` was not given (nothing is written)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir} is a file, not a folder")
    found = run_artifacts(out_dir)
    if found and not overwrite:
        raise ConfigError(
            f"{out_dir} already holds a run ({', '.join(found)}): continue it with --resume {out_dir}, "
            "replace it with --overwrite, or choose another --out"
        )


def start_new_run(out_dir: Path, *, overwrite: bool) -> None:
    """Claim `out_dir` for a new run, at the moment it starts: an earlier run's files go only under --overwrite."""
    refuse_existing_run(out_dir, overwrite=overwrite)
    for name in run_artifacts(out_dir):
        path = out_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)


def check_resumable(out_dir: Path) -> None:
    """`--resume DIR` needs a run folder there (a fresh start would be `--out`)."""
    if not out_dir.is_dir():
        raise ConfigError(f"--resume {out_dir}: no such run folder")
    if not run_artifacts(out_dir):
        raise ConfigError(f"--resume {out_dir}: the folder holds no run (start one with --out {out_dir})")


def finished_summary(out_dir: Path, rounds: int) -> dict[str, Any] | None:
    """The summary of a run that already finished all `rounds` (so resuming it is a no-op), else None."""
    summary_path = out_dir / "summary.json"
    newest = latest_checkpoint(out_dir / "checkpoints", warn=False)
    if newest is None or not summary_path.is_file():
        return None
    try:
        manifest = json.loads((newest / "manifest.json").read_text())
        summary = json.loads(summary_path.read_text())
    except (OSError, ValueError):
        return None
    if int(manifest.get("round", -1)) + 1 < rounds or not isinstance(summary, dict):
        return None
    return summary


__all__ = [
    "RUN_ARTIFACTS",
    "check_resumable",
    "finished_summary",
    "refuse_existing_run",
    "run_artifacts",
    "start_new_run",
]
