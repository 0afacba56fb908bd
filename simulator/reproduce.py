"""Reproductions: one seed paper's comparison, run at a named scale over several seeds, judged by its claims.

A comparison is a TOML preset (examples/reproduce/NAME.toml): the methods it compares with the paper's figures,
the orderings the paper claims ("nefl-wd > fjord on worst"), and per scale the [run]/[data]/[model]/[train]
tables every method shares. Seeds, partitions and the test set are identical across the methods of one seed
because all of them derive from `run.seed` and the shared tables; only the method and its options differ.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nestling.config import SimConfig, config_from_dict
from nestling.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PRESET_DIR = Path(__file__).resolve().parents[1] / "examples" / "reproduce"
SCALES = ("small", "paper")
SHARED_SECTIONS = ("run", "data", "model", "train")


@dataclass(frozen=True)
class Entry:
    """One method of a comparison: its label in tables, the method it runs, its options and paper figures."""

    label: str
    method: str
    options: dict[str, Any] = field(default_factory=dict)
    paper: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Claim:
    """`better` beats `worse` on `metric`, as the paper reports."""

    better: str
    worse: str
    metric: str

    @classmethod
    def parse(cls, text: str) -> Claim:
        """Read "A > B on METRIC"."""
        left, sep, metric = text.partition(" on ")
        better, gt, worse = left.partition(">")
        if not sep or not gt or not better.strip() or not worse.strip() or not metric.strip():
            raise ConfigError(f"claim {text!r} must read 'A > B on METRIC'")
        return cls(better.strip(), worse.strip(), metric.strip())

    def __str__(self) -> str:
        return f"{self.better} > {self.worse} on {self.metric}"


@dataclass(frozen=True)
class Comparison:
    """A preset resolved at one scale: what to run and how to judge it."""

    name: str
    title: str
    source: str
    scale: str
    note: str
    shared: dict[str, dict[str, Any]]
    entries: tuple[Entry, ...]
    claims: tuple[Claim, ...]
    metrics: tuple[str, ...]

    def config(self, entry: Entry, seed: int, data_root: str | None = None) -> SimConfig:
        """The simulate config of one method and seed; everything but the method is shared."""
        data = {section: dict(values) for section, values in self.shared.items()}
        data.setdefault("run", {})["seed"] = seed
        data["run"].setdefault("checkpoint_every", 1)  # resumable
        if data_root is not None:
            data.setdefault("data", {})["root"] = data_root
        data["method"] = {"name": entry.method, **entry.options}
        return config_from_dict(data)

    def entry(self, label: str) -> Entry:
        for candidate in self.entries:
            if candidate.label == label:
                return candidate
        raise ConfigError(f"[{self.name}] no method labelled {label!r}")


def preset_path(name_or_path: str) -> Path:
    """A preset by comparison name (examples/reproduce/NAME.toml) or by file path."""
    candidate = Path(name_or_path)
    if candidate.suffix == ".toml" and candidate.is_file():
        return candidate
    path = PRESET_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PRESET_DIR.glob("*.toml"))) or "none found"
        raise ConfigError(f"no reproduction named {name_or_path!r} (known: {known}; or pass a .toml path)")
    return path


def known_comparisons() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def load_comparison(name_or_path: str, scale: str) -> Comparison:
    """Read a preset and resolve it at `scale`; every method, claim and metric is checked up front."""
    path = preset_path(name_or_path)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    scales = raw.get("scales", {})
    if scale not in scales:
        raise ConfigError(f"{path.name} has no scale {scale!r} (has: {', '.join(sorted(scales))})")
    chosen = dict(scales[scale])
    note = str(chosen.pop("note", ""))
    unknown = set(chosen) - set(SHARED_SECTIONS)
    if unknown:
        raise ConfigError(f"{path.name} [scales.{scale}] unknown tables {sorted(unknown)}")
    entries = tuple(
        Entry(
            label=str(m.get("label", m["method"])),
            method=str(m["method"]),
            options=dict(m.get("options", {})),
            paper={k: float(v) for k, v in m.get("paper", {}).items()},
        )
        for m in raw.get("methods", [])
    )
    if len(entries) < 2:
        raise ConfigError(f"{path.name} compares fewer than two methods")
    labels = [e.label for e in entries]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"{path.name} repeats a method label: {labels}")
    metrics = tuple(str(m) for m in raw.get("metrics", ["worst", "avg"]))
    for metric in metrics:
        metric_reader(metric)
    claims = tuple(Claim.parse(text) for text in raw.get("claims", []))
    for claim in claims:
        for label in (claim.better, claim.worse):
            if label not in labels:
                raise ConfigError(f"{path.name} claim '{claim}' names {label!r}, not one of {labels}")
        if claim.metric not in metrics:
            raise ConfigError(
                f"{path.name} claim '{claim}' uses metric {claim.metric!r}, not one of {metrics}"
            )
    comparison = Comparison(
        name=str(raw.get("name", path.stem)),
        title=str(raw.get("title", path.stem)),
        source=str(raw.get("source", "")),
        scale=scale,
        note=note,
        shared={k: dict(v) for k, v in chosen.items()},
        entries=entries,
        claims=claims,
        metrics=metrics,
    )
    for entry in entries:  # every method's config must validate before hours of training start
        comparison.config(entry, seed=0)
    return comparison


# -- metrics of one evaluation (a metrics.jsonl record's "submodels" list) ---------------------------------


def metric_reader(metric: str) -> Callable[[list[dict[str, Any]]], float]:
    """worst / avg over submodels, full (the largest), level-K (K-th smallest by parameters, 1-based)."""
    if metric == "worst":
        return lambda subs: min(float(s["accuracy"]) for s in subs)
    if metric == "avg":
        return lambda subs: statistics.fmean(float(s["accuracy"]) for s in subs)
    if metric == "full":
        return lambda subs: float(max(subs, key=lambda s: s["parameters"])["accuracy"])
    if metric.startswith("level-") and metric[6:].isdigit() and int(metric[6:]) >= 1:
        rank = int(metric[6:]) - 1

        def level(subs: list[dict[str, Any]]) -> float:
            ordered = sorted(subs, key=lambda s: s["parameters"])
            if rank >= len(ordered):
                raise ConfigError(f"metric {metric} asks for level {rank + 1} of {len(ordered)} submodels")
            return float(ordered[rank]["accuracy"])

        return level
    raise ConfigError(f"unknown metric {metric!r} (known: worst, avg, full, level-K)")


@dataclass
class RunResult:
    """What one (method, seed) run contributes: final metrics, the curve of each metric, wall time."""

    label: str
    seed: int
    final: dict[str, float]
    curve: dict[str, list[tuple[int, float]]]
    wall_seconds: float
    rounds: int


def read_run(label: str, seed: int, run_dir: Path, metrics: tuple[str, ...]) -> RunResult:
    """Metrics of a finished run from its metrics.jsonl and summary.json."""
    records = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    evaluated = [r for r in records if r.get("submodels")]
    if not evaluated:
        raise ConfigError(f"{run_dir} has no evaluated round: set run.eval_every or evaluate at the end")
    readers = {m: metric_reader(m) for m in metrics}
    curve = {m: [(int(r["round"]), 100.0 * readers[m](r["submodels"])) for r in evaluated] for m in metrics}
    summary = json.loads((run_dir / "summary.json").read_text())
    return RunResult(
        label=label,
        seed=seed,
        final={m: points[-1][1] for m, points in curve.items()},
        curve=curve,
        wall_seconds=float(summary.get("wall_seconds", 0.0)),
        rounds=len(records),
    )


# -- judging -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spread:
    """Mean and sample standard deviation over seeds (0 with one seed)."""

    mean: float
    std: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        if not values:
            return cls(math.nan, math.nan, 0)
        return cls(
            statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0, len(values)
        )


@dataclass(frozen=True)
class Verdict:
    """One claim measured: margin = mean(better) - mean(worse); `clear` when it exceeds the seed spread,
    measured over at least two seeds of each method."""

    claim: Claim
    margin: float
    spread: float
    held: bool
    clear: bool
    seeds: int  # the fewer seeds of the two methods: one seed has no spread to exceed


def summarise_runs(comparison: Comparison, runs: list[RunResult]) -> dict[str, dict[str, Spread]]:
    """label -> metric -> Spread over seeds."""
    table: dict[str, dict[str, Spread]] = {}
    for entry in comparison.entries:
        mine = [r for r in runs if r.label == entry.label]
        table[entry.label] = {m: Spread.of([r.final[m] for r in mine]) for m in comparison.metrics}
    return table


def judge(comparison: Comparison, table: dict[str, dict[str, Spread]]) -> list[Verdict]:
    """Each claim with its margin against the larger of the two methods' seed spreads."""
    verdicts = []
    for claim in comparison.claims:
        better, worse = table[claim.better][claim.metric], table[claim.worse][claim.metric]
        margin = better.mean - worse.mean
        spread = max(better.std, worse.std)
        held = margin > 0
        seeds = min(better.n, worse.n)
        verdicts.append(Verdict(claim, margin, spread, held, held and seeds > 1 and margin > spread, seeds))
    return verdicts
