"""The replay report: PNG plots of a traced run plus an index.html that shows them, in <run>/report/."""

from __future__ import annotations

import html
import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from nestling.plotting import pyplot
from nestling.server.run_report import read_metrics
from nestling.simulator.replay import read_timeline

OUTCOME_COLOURS = {"used": "#2a9d8f", "dropped": "#e76f51", "cancelled": "#b8b8b8"}
PHASE_COLOURS = {"download": "#8ab6d6", "train": "#2a9d8f", "upload": "#f4a261"}


def hours_or_seconds(seconds: float) -> tuple[float, str]:
    """Axis unit that keeps tick labels short: seconds below 2 h, hours above."""
    return (3600.0, "h") if seconds > 7200 else (1.0, "s")


def round_spans(
    records: list[dict[str, Any]], timeline: list[dict[str, Any]]
) -> dict[int, tuple[float, float]]:
    """round → (first dispatch, close) in virtual seconds."""
    starts: dict[int, float] = {}
    for row in timeline:
        starts[row["round"]] = min(starts.get(row["round"], row["dispatched_at"]), row["dispatched_at"])
    return {r["round"]: (starts.get(r["round"], r["virtual_time"]), r["virtual_time"]) for r in records}


def plot_accuracy_vs_time(records: list[dict[str, Any]], path: Path, title: str) -> Path:
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for record in records:
        for sub in record.get("submodels", []):
            series[sub["name"]].append((record["virtual_time"], 100 * sub["accuracy"]))
    end = max((r["virtual_time"] for r in records), default=0.0)
    scale, unit = hours_or_seconds(end)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for name, points in series.items():
        ax.plot([t / scale for t, _ in points], [a for _, a in points], marker="o", markersize=3, label=name)
    ax.set_xlabel(f"virtual time ({unit})")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"Accuracy vs virtual time · {title}", fontsize=10)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=8, title="submodel", title_fontsize=8)
    return _save(fig, path)


def plot_round_durations(spans: dict[int, tuple[float, float]], path: Path) -> Path:
    durations = [end - start for start, end in spans.values()]
    scale, unit = hours_or_seconds(max(durations, default=0.0))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    if durations:
        values = [d / scale for d in durations]
        ax.hist(values, bins=min(30, max(5, len(values) // 2)), color="#457b9d", edgecolor="white")
        median = statistics.median(values)
        ax.axvline(median, color="#e63946", linestyle="--", label=f"median {median:.3g} {unit}")
        ax.legend(fontsize=8)
    ax.set_xlabel(f"round duration, first dispatch to close ({unit})")
    ax.set_ylabel("rounds")
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"Round durations ({len(durations)} rounds)", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def class_outcomes(timeline: list[dict[str, Any]], fleet: dict[str, int]) -> dict[str, Counter[str]]:
    """class → task outcome counts, plus `devices` (fleet size) and `contributors` (devices used once+)."""
    table: dict[str, Counter[str]] = {c: Counter(devices=n) for c, n in fleet.items()}
    contributors: dict[str, set[str]] = defaultdict(set)
    for row in timeline:
        table.setdefault(row["device_class"], Counter())[row["outcome"]] += 1
        if row["outcome"] == "used":
            contributors[row["device_class"]].add(row["device_id"])
    for c, devices in contributors.items():
        table[c]["contributors"] = len(devices)
    return dict(sorted(table.items()))


def plot_participation(outcomes: dict[str, Counter[str]], path: Path) -> Path:
    classes = list(outcomes)
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.0, 4.4), dpi=120)
    bottom = [0] * len(classes)
    for outcome, colour in OUTCOME_COLOURS.items():
        counts = [outcomes[c][outcome] for c in classes]
        left.bar(classes, counts, bottom=bottom, color=colour, label=outcome)
        bottom = [b + n for b, n in zip(bottom, counts)]
    left.set_ylabel("tasks dispatched")
    left.set_title("Tasks by outcome", fontsize=10)
    left.set_ylim(0, 1.25 * max(bottom, default=0) + 1)
    left.legend(fontsize=8, loc="upper center", ncol=3)
    xs = range(len(classes))
    tasks = [sum(outcomes[c][o] for o in OUTCOME_COLOURS) for c in classes]
    took_part = [
        100 * outcomes[c]["contributors"] / outcomes[c]["devices"] if outcomes[c]["devices"] else 0.0
        for c in classes
    ]
    dropped = [100 * outcomes[c]["dropped"] / n if n else 0.0 for c, n in zip(classes, tasks)]
    right.bar(
        [x - 0.2 for x in xs],
        took_part,
        width=0.4,
        color=OUTCOME_COLOURS["used"],
        label="devices that contributed (% of class)",
    )
    right.bar(
        [x + 0.2 for x in xs],
        dropped,
        width=0.4,
        color=OUTCOME_COLOURS["dropped"],
        label="tasks dropped (% of dispatched)",
    )
    right.set_xticks(list(xs), classes)
    right.set_ylim(0, 122)
    right.set_yticks(range(0, 101, 20))
    right.set_ylabel("%")
    right.set_title("Participation and dropout rate", fontsize=10)
    right.legend(fontsize=7, loc="upper center", ncol=2)
    for ax in (left, right):
        ax.tick_params(axis="x", labelrotation=35, labelsize=7)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("Participation and dropout by device class", fontsize=11)
    return _save(fig, path)


def gantt_round(timeline: list[dict[str, Any]]) -> int | None:
    """The round to draw: the most kinds of outcome, then the most dropouts, then the most tasks."""
    per_round: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in timeline:
        per_round[row["round"]].append(row)
    if not per_round:
        return None

    def interest(r: int) -> tuple[int, int, int, int]:
        rows = per_round[r]
        kinds = len({x["outcome"] for x in rows})
        return kinds, sum(x["outcome"] == "dropped" for x in rows), len(rows), -r

    return max(per_round, key=interest)


def plot_gantt(
    timeline: list[dict[str, Any]], round_index: int, close: float, path: Path, limit: int = 40
) -> Path:
    rows = sorted(
        (r for r in timeline if r["round"] == round_index), key=lambda r: (r["ends_at"], r["device_id"])
    )
    # Large rounds: tasks evenly spread over the end-time order, so early, closing and late ones all show.
    shown = (
        rows if len(rows) <= limit else [rows[i * len(rows) // limit] for i in range(limit - 1)] + rows[-1:]
    )
    start = min((r["dispatched_at"] for r in rows), default=0.0)
    scale, unit = hours_or_seconds(max((r["ends_at"] - start for r in shown), default=0.0))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9.0, max(3.0, 0.22 * len(shown) + 1.4)), dpi=120)
    for y, row in enumerate(shown):
        t0 = (row["dispatched_at"] - start) / scale
        t_end = (row["ends_at"] - start) / scale
        if row["outcome"] == "dropped":
            ax.barh(y, t_end - t0, left=t0, color=OUTCOME_COLOURS["dropped"], height=0.7)
            continue
        left = t0
        for phase, seconds in (
            ("download", row["down_s"]),
            ("train", row["compute_s"]),
            ("upload", row["up_s"]),
        ):
            ax.barh(
                y,
                seconds / scale,
                left=left,
                color=PHASE_COLOURS[phase],
                height=0.7,
                alpha=1.0 if row["outcome"] == "used" else 0.35,
            )
            left += seconds / scale
    ax.axvline((close - start) / scale, color="black", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(shown)), [f"{r['device_id']} · {r['device_class']}" for r in shown], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel(f"virtual time since the round's first dispatch ({unit}); dashed: round closed")
    note = f" ({len(shown)} of {len(rows)}, spread by end time)" if len(rows) > limit else ""
    ax.set_title(f"Round {round_index + 1}: one bar per task{note}", fontsize=10)
    from matplotlib.patches import Rectangle

    handles = [Rectangle((0, 0), 1, 1, color=c) for c in PHASE_COLOURS.values()]
    handles += [
        Rectangle((0, 0), 1, 1, color=OUTCOME_COLOURS["dropped"]),
        Rectangle((0, 0), 1, 1, color=PHASE_COLOURS["train"], alpha=0.35),
    ]
    labels = [*PHASE_COLOURS, "dropped (offline)", "cancelled (not needed)"]
    ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3, axis="x")
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    pyplot().close(fig)
    return path


def write_replay_report(out_dir: Path, title: str, fleet: dict[str, int] | None = None) -> Path:
    """Write report/ (four PNGs + index.html) from metrics.jsonl and timeline.jsonl; returns index.html.

    `fleet` (device class → devices) lets participation count devices that never got a task."""
    report = out_dir / "report"
    report.mkdir(exist_ok=True)
    records = read_metrics(out_dir)
    timeline = read_timeline(out_dir)
    spans = round_spans(records, timeline)
    outcomes = class_outcomes(timeline, fleet or {})
    figures = [
        (
            "Accuracy per submodel vs virtual time",
            plot_accuracy_vs_time(records, report / "accuracy_time.png", title),
        ),
        ("Round-duration distribution", plot_round_durations(spans, report / "round_durations.png")),
        (
            "Participation and dropout by device class",
            plot_participation(outcomes, report / "participation.png"),
        ),
    ]
    chosen = gantt_round(timeline)
    if chosen is not None:
        figures.append(
            (
                f"Timeline of round {chosen + 1}",
                plot_gantt(timeline, chosen, spans.get(chosen, (0.0, 0.0))[1], report / "gantt.png"),
            )
        )
    index = report / "index.html"
    index.write_text(_index_html(title, records, outcomes, figures))
    return index


def _index_html(
    title: str,
    records: list[dict[str, Any]],
    outcomes: dict[str, Counter[str]],
    figures: list[tuple[str, Path]],
) -> str:
    end = records[-1]["virtual_time"] if records else 0.0
    scale, unit = hours_or_seconds(end)
    rows = "".join(
        f"<tr><td>{html.escape(c)}</td><td>{n['devices']}</td><td>{n['contributors']}</td>"
        f"<td>{sum(n[o] for o in OUTCOME_COLOURS)}</td><td>{n['used']}</td><td>{n['dropped']}</td>"
        f"<td>{n['cancelled']}</td></tr>"
        for c, n in outcomes.items()
    )
    images = "".join(
        f"<figure><img src='{p.name}' alt='{html.escape(caption)}'><figcaption>{html.escape(caption)}"
        f"</figcaption></figure>"
        for caption, p in figures
    )
    facts = json.dumps({"rounds": len(records), "virtual_seconds": end})
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>Nestling replay · {html.escape(title)}</title><style>"
        "body{font-family:sans-serif;max-width:980px;margin:2em auto}img{max-width:100%}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}"
        "figure{margin:1.5em 0}figcaption{color:#555}</style></head><body>"
        f"<h1>Trace replay · {html.escape(title)}</h1>"
        f"<p>{len(records)} rounds in {end / scale:.4g} {unit} of virtual time.</p>"
        "<table><tr><th>device class</th><th>devices</th><th>contributed</th><th>tasks</th><th>used</th>"
        "<th>dropped</th><th>cancelled</th></tr>"
        f"{rows}</table>{images}<script type='application/json' id='facts'>{facts}</script></body></html>"
    )
