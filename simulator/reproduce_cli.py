"""`nestling reproduce NAME`: run a seed paper's comparison over seeds, resumably, and judge its claims."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from nestling.config import SimConfig, config_from_dict
from nestling.config_io import config_to_toml
from nestling.errors import ConfigError
from nestling.simulator.reproduce import (
    DEFAULT_SEEDS,
    SCALES,
    Comparison,
    Entry,
    RunResult,
    judge,
    known_comparisons,
    load_comparison,
    read_run,
    summarise_runs,
)
from nestling.simulator.reproduce_report import write_results

log = logging.getLogger(__name__)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Settings that do not change what a run computes: a run folder made with other values is still this run.
NEUTRAL_SETTINGS = frozenset({("run", "workers"), ("data", "root")})
# Settings added after runs were recorded whose default is not what those runs did: a config.toml without one
# is read with this value. Before [run] bn_statistics, BN running statistics were always averaged.
BEFORE_SETTINGS: dict[tuple[str, str], Any] = {("run", "bn_statistics"): "mean"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nestling reproduce",
        description="Run one seed comparison (examples/reproduce/NAME.toml) over seeds and check its claims.",
    )
    p.add_argument("name", help=f"comparison name ({', '.join(known_comparisons())}) or a preset .toml path")
    p.add_argument("--scale", choices=SCALES, default="small", help="small: 2 CPU cores; paper: a GPU box")
    p.add_argument(
        "--seeds",
        default=DEFAULT_SEEDS,
        help=f"comma-separated seeds (default {DEFAULT_SEEDS}); claims are judged per seed, paired",
    )
    p.add_argument("--out", type=Path, help="output folder (default runs/reproduce/NAME-SCALE)")
    p.add_argument("--data-root", help="dataset folder (default: $NESTLING_DATA_ROOT or ../shared/data)")
    p.add_argument("--only", help="comma-separated method labels to run (the table still reads all finished)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def default_data_root() -> str | None:
    """$NESTLING_DATA_ROOT, else ../shared/data beside the repository when it exists (the loaders' own rule)."""
    if os.environ.get("NESTLING_DATA_ROOT"):
        return os.environ["NESTLING_DATA_ROOT"]
    beside = Path(__file__).resolve().parents[2] / "shared" / "data"
    return str(beside) if beside.is_dir() else None


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--seeds expects comma-separated integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds must list distinct integers, got {text!r}")
    return seeds


def _flatten(table: dict[str, Any]) -> dict[tuple[str, str], Any]:
    return {(section, key): value for section, values in table.items() for key, value in values.items()}


def config_changes(run_dir: Path, cfg: SimConfig) -> list[str]:
    """The settings in which `cfg` differs from the config a run folder was made with (none for a new one)."""
    recorded = run_dir / "config.toml"
    if not recorded.is_file():
        return []
    try:  # read back through the config class, so a setting added since then counts at its default
        table = tomllib.loads(recorded.read_text())
        for (section, key), value in BEFORE_SETTINGS.items():
            table.setdefault(section, {}).setdefault(key, value)
        before = _flatten(tomllib.loads(config_to_toml(config_from_dict(table))))
    except (ConfigError, tomllib.TOMLDecodeError) as exc:
        return [f"its config.toml no longer reads ({exc})"]
    after = _flatten(tomllib.loads(config_to_toml(cfg)))
    return [
        f"{section}.{key}: {before.get((section, key))!r} -> {after.get((section, key))!r}"
        for section, key in sorted(before.keys() | after.keys())
        if (section, key) not in NEUTRAL_SETTINGS and before.get((section, key)) != after.get((section, key))
    ]


def run_state(run_dir: Path, cfg: SimConfig) -> str:
    """'done' (summary of all rounds written), 'partial' (a checkpoint to resume from) or 'new'.

    A folder made with another configuration (an edited preset, say) is refused rather than resumed or
    reported, which would silently mix two experiments in one table."""
    changes = config_changes(run_dir, cfg)
    if changes:
        raise ConfigError(
            f"{run_dir} was run with another configuration ({'; '.join(changes)}): "
            "delete that folder to rerun it, or pass another --out"
        )
    summary = run_dir / "summary.json"
    if summary.is_file() and int(json.loads(summary.read_text()).get("rounds", -1)) >= cfg.run.rounds:
        return "done"
    if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").glob("round-*/manifest.json")):
        return "partial"
    return "new"


def run_one(cfg: SimConfig, run_dir: Path, quiet: bool, title: str) -> None:
    """One method at one seed, resumed from its newest checkpoint when a previous attempt stopped; every
    delivered result's steps and MACs go to the run folder's compute.jsonl (reproduce_compute)."""
    from nestling.progress import RoundProgress
    from nestling.simulator.reproduce_compute import ComputeMeter
    from nestling.simulator.run import run_simulation

    state = run_state(run_dir, cfg)
    if state == "done":
        return
    with RoundProgress(cfg.run.rounds, enabled=not quiet, title=title) as progress:
        # "new" may still hold this configuration's attempt that stopped before its first checkpoint
        run_simulation(
            cfg,
            run_dir,
            resume=state == "partial",
            overwrite=state == "new",
            on_round=progress.update,
            observers=[ComputeMeter(run_dir)],
        )


def reproduce(
    comparison: Comparison,
    seeds: list[int],
    out_dir: Path,
    *,
    data_root: str | None = None,
    only: list[str] | None = None,
    quiet: bool = False,
    command: str = "",
) -> tuple[list[RunResult], dict[str, Path], str]:
    """Run every (seed, method) not yet finished, then write the table; returns runs, files and the last line."""
    for label in only or []:
        comparison.entry(label)

    def config_of(entry: Entry, seed: int) -> SimConfig | None:
        """The entry's config at `seed`; None for a derived entry whose source has not finished that seed."""
        if not entry.derive:
            return comparison.config(entry, seed, data_root)
        source = comparison.entry(entry.derive["from"])
        source_dir = out_dir / f"seed-{seed}" / source.label
        if run_state(source_dir, comparison.config(source, seed, data_root)) != "done":
            return None
        return comparison.config(entry, seed, data_root, source_run=source_dir)

    for seed in seeds:
        for entry in comparison.entries:  # a derived entry comes after its source (load_comparison checks)
            if only and entry.label not in only:
                continue
            cfg = config_of(entry, seed)
            if cfg is None:
                raise ConfigError(
                    f"{entry.label} at seed {seed} derives from {entry.derive['from']}, which has not finished "
                    "that seed: run it first (or drop --only)"
                )
            run_one(cfg, out_dir / f"seed-{seed}" / entry.label, quiet, f"{entry.label} · seed {seed}")
    runs = []
    for seed in seeds:
        for entry in comparison.entries:
            cfg = config_of(entry, seed)
            if cfg is not None and run_state(out_dir / f"seed-{seed}" / entry.label, cfg) == "done":
                runs.append(
                    read_run(
                        entry.label,
                        seed,
                        out_dir / f"seed-{seed}" / entry.label,
                        comparison.metrics,
                        entry.method,
                    )
                )
    for run in runs:
        if run.refused:
            log.warning(
                "%s at seed %d: the server refused honest results %s (a reproduction has no attacker)",
                run.label,
                run.seed,
                run.refused,
            )
    table = summarise_runs(comparison, runs)
    verdicts = judge(comparison, runs)
    files = write_results(out_dir, comparison, table, verdicts, runs, command)
    held = sum(v.held for v in verdicts)
    clear = sum(v.clear for v in verdicts)
    accuracies = " ".join(
        f"{entry.label}_{metric}={table[entry.label][metric].mean:.2f}"
        for entry in comparison.entries
        for metric in comparison.metrics
    )
    last = f"ordering_held={held}/{len(verdicts)} ordering_clear={clear}/{len(verdicts)} {accuracies}"
    return runs, files, last


def reproduce_main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    comparison = load_comparison(args.name, args.scale)
    out_dir = args.out or Path("runs") / "reproduce" / f"{comparison.name}-{args.scale}"
    out_dir.mkdir(parents=True, exist_ok=True)
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    command = "nestling reproduce " + " ".join(shlex.quote(a) for a in argv)
    _, files, last = reproduce(
        comparison,
        parse_seeds(args.seeds),
        out_dir,
        data_root=args.data_root or default_data_root(),
        only=only,
        quiet=args.quiet,
        command=command,
    )
    print(files["markdown"].read_text())
    print(f"results in {out_dir} ({', '.join(p.name for p in files.values())})")
    print(last)
    return 0
