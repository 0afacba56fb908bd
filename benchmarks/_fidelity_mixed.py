"""`benchmarks/fidelity.py --mixed`: a mixed, flaky fleet replayed in the simulator and run as emulated agents.

The trace: four CPU-training board classes (Raspberry Pi 3 B, Pi Zero 2 W, Pi 4 and a Jetson Nano's CPU: the
catalogue classes slow enough for this 2-core host to outrun while three train at once; the Nano's GPU, the
phones and the Pi 5 are 2-5x faster than one of its cores), each device spread log-normally around its class
(simulator/generate.py). A share of the devices churns: online and offline sessions of exponential length on
the trace's clock in hours (`with_sessions`), every device online at t = 0. The trace's clock runs
`--time-scale` times faster than the wall clock in both worlds: the simulator replays
`time_scaled(trace, scale)`, each agent runs `--emulate-availability --emulate-time-scale scale` and really
leaves the broker when its window closes (the task it holds is abandoned, its result never sent) and registers
again when the next opens. Over-selection and a deadline as a deployment would set them.

Compared round by round (benchmarks/_fidelity_compare.py): the devices selected, the results used before the
deadline, the devices lost mid-task, the round's duration; then time-to-accuracy (wall time from the first
round's dispatch to the close of the first round evaluated at the target) and each world's accuracy at the
wall time both ran. Tasks the host could not keep up with (overrun) are reported per round; if one may have
changed a round, the error figures read `host_bound` instead of measuring this host.

The server's own time between rounds (aggregation, evaluation, selection) moves the fleet's trace clock on, so
the replay is run three ways (`[run] server_time`, simulator/server_time.py): `none` (its clock stands still
between rounds; run before the fleet and reused across runs), `fixed` at the fleet's measured mean time between
rounds (the fair setting for a fidelity check: the simulator is judged on the boards, given the server's
speed), and `measured` (the replay times its own server work: the prediction a user has without a fleet).
A fourth replay, the fair one, also models the fleet transport inside a round (`[run] transport_time`,
simulator/transport_time.py: the server encoding and publishing a round's tasks one after another, a broker hop
each way, the server collecting each result), with figures measured apart from the fleet on the same server
code and broker (benchmarks/_fidelity_transport.py, or `--transport-from` a file it wrote). The round table and
the last line are that replay's; the other three are summarised above it.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.fidelity --mixed
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from benchmarks._fidelity_compare import (
    Verdict,
    comings_and_goings,
    final_line,
    fleet_outcomes,
    left_mid_task,
    pair_rounds,
    replay_outcomes,
    round_table,
    verdict,
)
from benchmarks.fidelity import read_fleet_run, read_jsonl, run_fleet, run_simulator

MIXED_MIX = "rpi3b:1,rpi-zero2w:1,rpi4:1,jetson-nano-cpu:1"
MIXED_DEFAULTS: dict[str, Any] = {
    "devices": 12,
    # Two devices asked, the first result used: two trainings at once is what this 2-core host can run at the
    # fast classes' speed (with three at once it trained at 5-21 GFLOP/s, median 8, and fell 1-3 s behind the
    # 10-12.5 GFLOP/s Pi 4s and Nano CPUs in 10 of 12 rounds, 2026-11-26 20:10 at load 3-6).
    "per_round": 1,
    "over_selection": 2.0,
    "rounds": 12,
    "mix": MIXED_MIX,
    "deadline": 15.0,
    "local_epochs": 5,
    "seed": 30,
}
# What the server counts when bytes travel twice (server/chunk_exchange.py, server/mqtt_transport.py).
RETRANSMISSION_COUNTERS = ("rerequests", "task_chunks_resent", "tasks_resent")
# The fair replay (the round table and the last line): the server's time between rounds fixed at the fleet's,
# and the transport inside a round modelled from a separate measurement (transport_time).
FAIR = "fixed+transport"
HOUR_S = 3600.0
DAY_S = 86400.0


def mixed_traces(a: argparse.Namespace) -> list[Any]:
    """The seeded trace on its own clock (hours): the class mix, with a churning share of the devices."""
    from nestling.simulator.generate import generate_fleet, with_sessions

    traces = generate_fleet(a.mix, a.devices, seed=a.seed, diurnal=False)
    return with_sessions(traces, a.churn, a.online_h * HOUR_S, a.offline_h * HOUR_S, DAY_S, seed=a.seed)


def window_deviations(agent_logs: Mapping[str, str], scaled: Mapping[str, Any]) -> list[float]:
    """For every departure and return an agent logged: seconds between its trace time and the nearest edge of
    its (scaled) trace's windows that it should have crossed (0 = exactly on the trace's clock)."""
    deviations = []
    for device, text in agent_logs.items():
        trace = scaled[device]
        ends = [end for _, end in trace.availability]
        starts = [start for start, _ in trace.availability]
        for kind, t in comings_and_goings(text):
            edges = ends if kind == "left" else starts
            deviations.append(min((abs(t - e) for e in edges), default=math.inf))
    return deviations


def server_gaps(metrics: Sequence[Mapping[str, Any]]) -> list[float]:
    """Seconds between one round's close and the next one's dispatch: the server's own work (screening,
    aggregation, evaluation, checkpoint, selection), which a replay's clock moves by only with `server_time`."""
    ordered = sorted(metrics, key=lambda r: int(r["round"]))
    return [float(b["dispatched_at"]) - float(a["closed_at"]) for a, b in pairwise(ordered)]


def fixed_server_time(
    fleet_metrics: Sequence[Mapping[str, Any]], seconds: float | None = None
) -> dict[str, Any]:
    """The [run] keys of a replay whose clock moves by `seconds` a round, by default the fleet's mean measured
    time between rounds (every gap holds an evaluation: the benchmark evaluates every round, and checkpoints
    only after the last)."""
    if seconds is not None:
        return {"server_time": "fixed", "server_round_s": seconds}
    gaps = server_gaps(fleet_metrics)
    if not gaps:
        raise ValueError("the fleet ran one round: no time between rounds was measured")
    return {"server_time": "fixed", "server_round_s": round(statistics.fmean(gaps), 6)}


def unmodelled(
    v: Verdict, fleet_metrics: Sequence[Mapping[str, Any]], counters: Mapping[str, Any]
) -> list[str]:
    """What the replay leaves out, as measured in this run: transport inside a round, server time between
    rounds, retransmissions."""
    same = [row for row in v.rows if row.same_selection and not row.host_bound]
    transport = [row.fleet.duration_s - row.simulated.duration_s for row in same]
    gaps = server_gaps(fleet_metrics)
    lines = []
    if transport:
        share = statistics.median(
            (row.fleet.duration_s - row.simulated.duration_s) / row.simulated.duration_s for row in same
        )
        lines.append(
            f"broker and transport inside a round beyond the replay's (fleet - simulated, {len(same)} rounds with "
            "the same sets): "
            f"median {statistics.median(transport) * 1e3:+.0f} ms ({share:+.1%} of the round)"
        )
    if gaps:
        mean_round = statistics.mean(row.fleet.duration_s for row in v.rows)
        lines.append(
            f"server time between rounds (aggregation, evaluation, selection; not in a round's span): fleet mean "
            f"{statistics.mean(gaps):.3f} s, max {max(gaps):.3f} s ({statistics.mean(gaps) / mean_round:.1%} of a "
            "mean round)"
        )
    resent = {k: counters.get(k, 0) for k in RETRANSMISSION_COUNTERS}
    lines.append(
        "retransmissions (server counters; the replay sends every byte once): "
        + ", ".join(f"{k}={v}" for k, v in resent.items())
    )
    return lines


def describe(v: Verdict) -> list[str]:
    """The round table, time-to-accuracy in both worlds, and the host-bound warning when there is one."""
    lines = [round_table(v)]
    for world, tta, acc in (
        ("simulator", v.tta_simulated_s, v.accuracy_simulated),
        ("fleet", v.tta_fleet_s, v.accuracy_fleet),
    ):
        reached = "never" if tta is None else f"{tta:.1f} s"
        at = "–" if acc is None else f"{100 * acc:.1f} %"
        lines.append(
            f"{world}: reaches {100 * v.target_accuracy:.1f} % after {reached}; accuracy at {v.equal_time_s:.1f} s: {at}"
        )
    if v.host_bound_rounds:
        lines.append(
            f"HOST-BOUND: the host fell behind its emulated boards in rounds {v.host_bound_rounds} by more than "
            "5 % of the round (column 'host overrun'): the fleet's times there measure this host, not the "
            "simulator; rerun on a quieter host"
        )
    return lines


def replay_fingerprint(
    a: argparse.Namespace, trace_path: Path, server: Mapping[str, Any] | None = None
) -> str:
    """What makes two replays the same: every setting but where and how long to run, the replay's server
    time, and the trace itself."""
    settings = {
        k: v
        for k, v in vars(a).items()
        if k
        not in ("out", "replay_only", "timeout", "settle", "fleet_from", "fixed_server_s", "transport_from")
    }
    extra = {"server": dict(server)} if server else {}
    return json.dumps({**settings, **extra, "trace": trace_path.read_text()}, sort_keys=True, default=str)


def replay_once(
    a: argparse.Namespace, trace_path: Path, out: Path, server: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The replay (with `server`'s [run] server_time keys), or the one already in `out` from the same settings
    and trace: virtual time does not depend on this host's load, so `--replay-only` can run it before the box
    is quiet. A `measured` server time does depend on it and is never reused."""
    fingerprint = replay_fingerprint(a, trace_path, server)
    stamp = out / "replay-settings.json"
    if can_reuse(out, fingerprint, server):
        print(f"reusing the replay in {out} (same settings and trace)")
        return {
            "metrics": read_jsonl(out / "metrics.jsonl"),
            "timeline": read_jsonl(out / "timeline.jsonl"),
            "seconds": 0.0,
        }
    stamp.unlink(missing_ok=True)
    sim = run_simulator(a, trace_path, out, server)
    stamp.write_text(fingerprint)
    return sim


def can_reuse(out: Path, fingerprint: str, server: Mapping[str, Any] | None = None) -> bool:
    """Whether `out` holds a finished replay made with `fingerprint`, and one worth reusing: a replay that timed
    its own server work measured this host at that moment."""
    stamp = out / "replay-settings.json"
    if server and server.get("server_time") == "measured":
        return False
    return stamp.exists() and stamp.read_text() == fingerprint and (out / "timeline.jsonl").exists()


def recorded_fleet(a: argparse.Namespace, trace_path: Path) -> dict[str, Any]:
    """The fleet run kept in `--fleet-from`, refused unless it ran this very trace (same settings, same seed)."""
    recorded = a.fleet_from.resolve()
    kept = recorded / "fleet.jsonl"
    if not (recorded / "fleet" / "metrics.jsonl").is_file() or not kept.is_file():
        raise ValueError(
            f"--fleet-from {recorded}: no finished fleet run there (fleet/metrics.jsonl, fleet.jsonl)"
        )
    if kept.read_text() != trace_path.read_text():
        raise ValueError(f"--fleet-from {recorded}: its fleet ran another trace than these settings make")
    print(f"comparing against the fleet recorded in {recorded}")
    return {**read_fleet_run(recorded, a.devices), "agents_ready_s": math.nan, "seconds": math.nan}


def transport_time(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The fair replay's [run] transport_time keys: from `--transport-from`, else measured now on this host by
    benchmarks/_fidelity_transport.py (kept in transport-time.json). Never fitted to the fleet's rounds."""
    from benchmarks._fidelity_transport import measure_transport_time
    from nestling.config import TRANSPORT_TIME_KEYS

    if a.transport_from is not None:
        measured = json.loads(a.transport_from.read_text())
        missing = [k for k in ("transport_time", *TRANSPORT_TIME_KEYS) if k not in measured]
        if missing:
            raise ValueError(f"--transport-from {a.transport_from}: no {', '.join(missing)}")
    else:
        measured = measure_transport_time()
        from nestling.strict_json import write_strict_json

        write_strict_json(work / "transport-time.json", measured, indent=1)
    return {k: measured[k] for k in ("transport_time", *TRANSPORT_TIME_KEYS)}


def replay_server_seconds(out: Path) -> list[float]:
    """The seconds a replay's clock moved after each round (its server_time.jsonl; none when it did not)."""
    from nestling.simulator.server_time import read_server_time

    return [float(row["server_s"]) for row in read_server_time(out)]


def host_speeds(
    emulation: Mapping[int, Mapping[str, Mapping[str, float]]], gflops: Mapping[str, float]
) -> list[float]:
    """GFLOP/s this host trained each task at (the board's FLOPs over the host's own training seconds), with
    as many tasks training at once as the run had: what decides which classes it can emulate."""
    rates = []
    for by_device in emulation.values():
        for device, figures in by_device.items():
            if figures["host_s"] > 0 and device in gflops:
                rates.append(figures["compute_s"] * gflops[device] / figures["host_s"])
    return sorted(rates)


def as_measured(v: Verdict) -> str:
    """A host-bound comparison's figures as measured, host included (empty when no round was host-bound)."""
    if not v.host_bound_rounds:
        return ""
    errors = [abs(row.error) for row in v.rows]
    tta = "none" if v.tta_error is None else f"{abs(v.tta_error):.3f}"
    return (
        f" (as measured, host included: median |error| {statistics.median(errors):.3f}, worst "
        f"{max(errors):.3f}, tta error {tta})"
    )


def _dropped(sim: Mapping[str, Any]) -> int:
    return sum(row["outcome"] == "dropped" for row in sim["timeline"])


def run_mixed(a: argparse.Namespace) -> int:
    from nestling.profiler.traces import save_traces, time_scaled
    from nestling.simulator.fleetdata import device_id

    with tempfile.TemporaryDirectory() as scratch:
        work = (a.out or Path(scratch)).resolve()
        work.mkdir(parents=True, exist_ok=True)
        traces = mixed_traces(a)
        trace_path, scaled_path = work / "fleet.jsonl", work / "fleet-scaled.jsonl"
        save_traces(traces, trace_path)
        scaled = [time_scaled(t, a.time_scale) for t in traces]
        save_traces(scaled, scaled_path)
        sim = replay_once(a, scaled_path, work / "sim")
        if a.replay_only:
            print(f"replay in {work / 'sim'}: {len(sim['metrics'])} rounds, {_dropped(sim)} dropouts")
            return 0
        if a.fleet_from is not None:
            fleet, fleet_dir = recorded_fleet(a, trace_path), a.fleet_from.resolve()
        else:
            flags = ["--emulate-availability", "--emulate-time-scale", repr(a.time_scale)]
            fleet, fleet_dir = run_fleet(a, traces, trace_path, work, agent_flags=flags), work
        summary_counters = _fleet_counters(fleet_dir / "fleet")
        # After the fleet, so they cannot disturb it: the replay given the fleet's server time, and the one
        # that measures its own.
        fixed = fixed_server_time(fleet["metrics"], a.fixed_server_s)
        transport = transport_time(a, work)
        replays = {
            "none": sim,
            "fixed": replay_once(a, scaled_path, work / "sim-fixed", fixed),
            "measured": replay_once(a, scaled_path, work / "sim-measured", {"server_time": "measured"}),
            FAIR: replay_once(a, scaled_path, work / "sim-transport", {**fixed, **transport}),
        }
        moved = {mode: replay_server_seconds(work / f"sim-{mode}") for mode in ("fixed", "measured")}
    lost = left_mid_task(fleet["agent_logs"])
    real = fleet_outcomes(fleet["metrics"], lost)
    overruns = {r: {d: f["overrun_s"] for d, f in by.items()} for r, by in fleet["emulation"].items()}
    verdicts = {
        mode: verdict(
            pair_rounds(replay_outcomes(run["metrics"], run["timeline"]), real, overruns), a.target_share
        )
        for mode, run in replays.items()
    }
    v = verdicts[FAIR]
    simulated = [row.simulated for row in v.rows]
    classes = Counter(t.device_class for t in traces)
    churning = sum(bool(t.availability) for t in traces)
    by_id = {device_id(i): scaled[i] for i in range(len(traces))}
    deviations = window_deviations(fleet["agent_logs"], by_id)
    dropouts = sum(len(devices) for devices in lost.values())
    print(
        f"trace: {a.devices} devices ({', '.join(f'{n} {c}' for c, n in classes.items())}; seed {a.seed}), "
        f"{churning} come and go (sessions {a.online_h:g} h online / {a.offline_h:g} h offline on average), "
        f"clock x{a.time_scale:g}; {a.model} on {a.dataset}, {a.method}, {a.per_round} results a round from "
        f"{math.ceil(a.per_round * a.over_selection)} asked, deadline {a.deadline:g} s, {a.local_epochs} local epochs"
    )
    print(
        "GFLOP/s: "
        + ", ".join(
            f"{device_id(i)[-2:]}={t.gflops:g}{'*' if t.availability else ''}" for i, t in enumerate(traces)
        )
        + " (* comes and goes)"
    )
    ran = (
        f"recorded in {a.fleet_from}"
        if a.fleet_from is not None
        else f"{fleet['seconds']:.1f} s wall ({fleet['agents_ready_s']:.1f} s starting {a.devices} agents)"
    )
    print(
        f"simulator: {sum(run['seconds'] for run in replays.values()):.1f} s for four replays; fleet: {ran}"
    )
    rates = host_speeds(fleet["emulation"], {device_id(i): t.gflops for i, t in enumerate(traces)})
    if rates:
        print(
            f"host: trained {len(rates)} tasks at {rates[0]:.1f}-{rates[-1]:.1f} GFLOP/s "
            f"(median {statistics.median(rates):.1f}) with up to {math.ceil(a.per_round * a.over_selection)} at once"
        )
    print(
        f"windows: {len(deviations)} departures and returns by the agents, each within "
        f"{max(deviations, default=0.0):.3f} s of its trace's window edge (scaled clock)"
    )
    print(
        f"dropouts (left holding a task, result never sent): fleet {dropouts}, simulator "
        f"{sum(len(o.dropped) for o in simulated)}"
    )
    print(
        f"replay server time: fixed {fixed['server_round_s']:.3f} s a round "
        f"({'--fixed-server-s' if a.fixed_server_s is not None else 'the fleet mean between rounds'}); "
        f"measured by the replay itself: mean {statistics.fmean(moved['measured'] or [0.0]):.3f} s, "
        f"{min(moved['measured'] or [0.0]):.3f}-{max(moved['measured'] or [0.0]):.3f} s"
    )
    source = a.transport_from or "measured after the fleet (benchmarks/_fidelity_transport.py)"
    print(
        "replay transport time: "
        + " ".join(f"{k}={transport[k]}" for k in transport if k != "transport_time")
        + f" ({source})"
    )
    for mode in ("none", "measured", "fixed", FAIR):
        print(
            f"server_time={mode}: {final_line(verdicts[mode], len(classes), dropouts)}{as_measured(verdicts[mode])}"
        )
    print(f"round by round, server_time={FAIR}:")
    for line in describe(v):
        print(line)
    for line in unmodelled(v, fleet["metrics"], summary_counters):
        print(line)
    if v.host_bound_rounds:
        print(as_measured(v).strip())
    print(final_line(v, len(classes), dropouts))
    return 0


def _fleet_counters(out: Path) -> dict[str, Any]:
    path = out / "summary.json"
    if not path.exists():
        return {}
    summary = json.loads(path.read_text())
    counters = summary.get("counters") or summary.get("transport") or {}
    return counters if isinstance(counters, dict) else {}
