"""Reproductions: one seed paper's comparison, run at a named scale over several seeds, judged by its claims.

A comparison is a TOML preset (examples/reproduce/NAME.toml): the methods it compares with the paper's figures,
the orderings the paper claims ("nefl-wd > fjord on worst"), and per scale the [run]/[data]/[model]/[train]
tables every method shares. Seeds, partitions and the test set are identical across the methods of one seed
because all of them derive from `run.seed` and the shared tables; only the method and its options differ.
So a claim is judged per seed, paired: the same seed is the same partition, initial weights and draws, and a
claim is *clear* only when it holds on every seed both methods finished and its mean paired margin exceeds the
spread of the paired margins (`judge`). A method's options may also come from another method's finished run of
the same seed (`derive`, e.g. HeteroFL on FedTrans's final largest model): the command runs both phases.
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
from nestling.server.run_report import smallest_submodel

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PRESET_DIR = Path(__file__).resolve().parents[1] / "examples" / "reproduce"
SCALES = ("small", "paper")
SHARED_SECTIONS = ("run", "data", "model", "train")
DEFAULT_SEEDS = "0,1,2"  # three seeds: two cannot tell a seed that disagrees from noise


@dataclass(frozen=True)
class Entry:
    """One method of a comparison: its label in tables, the method it runs, its options and paper figures."""

    label: str
    method: str
    options: dict[str, Any] = field(default_factory=dict)
    paper: dict[str, float] = field(default_factory=dict)
    # {"from": LABEL, "rule": NAME}: options and [model] changes come from LABEL's finished run of the same seed
    derive: dict[str, str] = field(default_factory=dict)


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

    def config(
        self, entry: Entry, seed: int, data_root: str | None = None, source_run: Path | None = None
    ) -> SimConfig:
        """The simulate config of one method and seed; everything but the method is shared.

        A derived entry reads `source_run` (its source method's finished run of this seed); without one (a
        preset being checked before anything ran) it is built as if the source had not changed the model."""
        data = {section: dict(values) for section, values in self.shared.items()}
        data.setdefault("run", {})["seed"] = seed
        data["run"].setdefault("checkpoint_every", 1)  # resumable
        if data_root is not None:
            data.setdefault("data", {})["root"] = data_root
        options = dict(entry.options)
        if entry.derive:
            from nestling.simulator.reproduce_derive import derived_settings

            source = self.entry(entry.derive["from"])
            extra_options, model_changes = derived_settings(
                entry.derive["rule"], self.config(source, seed, data_root), source_run
            )
            options.update(extra_options)
            data["model"] = {**data.get("model", {}), **model_changes}
        data["method"] = {"name": entry.method, **options}
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
            derive={str(k): str(v) for k, v in m.get("derive", {}).items()},
        )
        for m in raw.get("methods", [])
    )
    if len(entries) < 2:
        raise ConfigError(f"{path.name} compares fewer than two methods")
    labels = [e.label for e in entries]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"{path.name} repeats a method label: {labels}")
    for position, entry in enumerate(entries):
        if entry.derive:
            from nestling.simulator.reproduce_derive import RULES

            if set(entry.derive) != {"from", "rule"} or entry.derive["rule"] not in RULES:
                raise ConfigError(
                    f"{path.name} method {entry.label!r}: derive needs from = LABEL and rule = one of "
                    f"{sorted(RULES)}, got {entry.derive}"
                )
            if entry.derive["from"] not in labels[:position]:
                raise ConfigError(
                    f"{path.name} method {entry.label!r} derives from {entry.derive['from']!r}, "
                    "which must be a method listed before it"
                )
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


SUMMARY_METRICS = ("clients",)  # read from summary.json at the end, not from every evaluation


def metric_reader(metric: str) -> Callable[[list[dict[str, Any]]], float]:
    """worst (METHODS' smallest submodel: fewest parameters, then fewest MACs — not the lowest accuracy over
    submodels), avg over submodels, full (the largest), level-K (K-th smallest by parameters, 1-based);
    clients: the mean over boards of each board's accuracy on the model it deploys (summary.json `boards`)."""
    if metric == "worst":
        return lambda subs: float(smallest_submodel(subs)["accuracy"])
    if metric == "clients":
        return lambda subs: math.nan  # only at the end of a run, from summary.json (read_run)
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
    raise ConfigError(f"unknown metric {metric!r} (known: worst, avg, full, level-K, clients)")


@dataclass
class RunResult:
    """What one (method, seed) run contributes: final metrics, the curve of each metric, wall time."""

    label: str
    seed: int
    final: dict[str, float]
    curve: dict[str, list[tuple[int, float]]]
    wall_seconds: float
    rounds: int
    compute: dict[str, float] = field(default_factory=dict)  # per client-round: steps and training MACs
    # Results the server's screens refused, by counter. A reproduction has no attacker, so every one is an
    # honest board refused: the table shows them (issue 29: non-IID presets must never refuse honest boards).
    refused: dict[str, int] = field(default_factory=dict)
    # What the boards trained beyond the task's model, in the method's words (Strategy.describe_trained).
    trained: str = ""


def read_run(
    label: str, seed: int, run_dir: Path, metrics: tuple[str, ...], method: str | None = None
) -> RunResult:
    """Metrics of a finished run from its metrics.jsonl and summary.json (with `method`, also what its boards
    trained as that method describes it)."""
    records = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    evaluated = [r for r in records if r.get("submodels")]
    if not evaluated:
        raise ConfigError(f"{run_dir} has no evaluated round: set run.eval_every or evaluate at the end")
    readers = {m: metric_reader(m) for m in metrics if m not in SUMMARY_METRICS}
    curve = {
        m: [(int(r["round"]), 100.0 * read(r["submodels"])) for r in evaluated] for m, read in readers.items()
    }
    summary = json.loads((run_dir / "summary.json").read_text())
    if "clients" in metrics:
        boards = summary.get("boards") or {}
        if not isinstance(boards.get("mean"), (int, float)):
            raise ConfigError(f"{run_dir}/summary.json has no boards' mean accuracy for metric 'clients'")
        curve["clients"] = [(int(evaluated[-1]["round"]), 100.0 * float(boards["mean"]))]
    from nestling.simulator.reproduce_compute import read_compute

    return RunResult(
        label=label,
        seed=seed,
        final={m: curve[m][-1][1] for m in metrics},
        curve={m: curve[m] for m in metrics},
        wall_seconds=float(summary.get("wall_seconds", 0.0)),
        rounds=len(records),
        compute=read_compute(run_dir),
        refused=refused_counts(records),
        trained=describe_trained(method, summary.get("method_report") or {}),
    )


def describe_trained(method: str | None, method_report: dict[str, Any]) -> str:
    """The method's own line on what its boards trained (empty for an unknown method or nothing to say)."""
    from nestling.server.strategies import STRATEGIES  # the package registers every built-in method

    strategy = STRATEGIES.get(method) if method else None
    return strategy.describe_trained(method_report) if strategy is not None else ""


def refused_counts(records: list[dict[str, Any]]) -> dict[str, int]:
    """Every `rejected_*` counter of a run's rounds, summed (the counters the screens raise on a refusal)."""
    total: dict[str, int] = {}
    for record in records:
        for key, value in (record.get("counters") or {}).items():
            if key.startswith("rejected_") and isinstance(value, int) and value:
                total[key] = total.get(key, 0) + value
    return dict(sorted(total.items()))


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
    """One claim judged per seed, paired over the seeds both methods finished (`margins`: seed → better − worse).

    margin = mean paired margin; spread = sample standard deviation of the paired margins; held = margin > 0;
    clear = at least two paired seeds, better ahead on every one of them, and margin > spread."""

    claim: Claim
    margin: float
    spread: float
    held: bool
    clear: bool
    seeds: int  # paired seeds: one seed has no spread to exceed
    margins: dict[int, float] = field(default_factory=dict)

    @property
    def every_seed(self) -> bool:
        return bool(self.margins) and all(m > 0 for m in self.margins.values())


def summarise_runs(comparison: Comparison, runs: list[RunResult]) -> dict[str, dict[str, Spread]]:
    """label -> metric -> Spread over the seeds that method finished."""
    table: dict[str, dict[str, Spread]] = {}
    for entry in comparison.entries:
        mine = [r for r in runs if r.label == entry.label]
        table[entry.label] = {m: Spread.of([r.final[m] for r in mine]) for m in comparison.metrics}
    return table


def paired_verdict(claim: Claim, better: dict[int, float], worse: dict[int, float]) -> Verdict:
    """`claim` judged on the seeds both sides have (seed → final metric); other seeds are left out of both."""
    seeds = sorted(set(better) & set(worse))
    margins = {seed: better[seed] - worse[seed] for seed in seeds}
    if not margins:
        return Verdict(claim, math.nan, math.nan, False, False, 0, {})
    values = list(margins.values())
    margin = statistics.fmean(values)
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    held = margin > 0
    clear = len(values) > 1 and all(v > 0 for v in values) and margin > spread
    return Verdict(claim, margin, spread, held, clear, len(values), margins)


def judge(comparison: Comparison, runs: list[RunResult]) -> list[Verdict]:
    """Every claim judged per seed, paired (`paired_verdict`), from the finished runs."""
    verdicts = []
    for claim in comparison.claims:
        sides = [
            {r.seed: r.final[claim.metric] for r in runs if r.label == label}
            for label in (claim.better, claim.worse)
        ]
        verdicts.append(paired_verdict(claim, sides[0], sides[1]))
    return verdicts
