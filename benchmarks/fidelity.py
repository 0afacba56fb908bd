"""Fidelity: one 20-device trace replayed in the simulator and on a loopback MQTT fleet of emulated agents.

Goal (issue 6): per-round duration error of the simulator against the real fleet, median |error| <= 10 %,
worst round <= 20 %.

1. A seeded synthetic trace (simulator/generate.py, no diurnal windows: every device is online
   throughout, so availability cannot differ between the two worlds) of the slowest catalogue class,
   Raspberry Pi 4 (each device with its own log-normally spread GFLOP/s, links and latency).
2. The simulator replays it on its virtual clock (`run.traces`, the same Coordinator).
3. A real fleet replays it in wall-clock time: the embedded broker (`nestling broker`, amqtt),
   `nestling server`, and one `nestling agent --emulate-trace TRACE --emulate-device ID` process per
   trace device (agent i = trace device i = simulator device i, same data partition, same memory
   budget), each padding its compute to its device's GFLOP/s and pacing its transfers to its links.

Both use the same method, seed, clients per round (no over-selection: a round waits for all of its
devices), deadline and quorum, so they pick the same devices every round. A round's duration is
`closed_at - dispatched_at` of metrics.jsonl in both: from the moment the server starts sending the
round's tasks to the moment it holds the last result it needs. The server's own per-round work
(selection, aggregation, evaluation, checkpoint) is outside that span in both worlds; the fleet's
real costs inside it (encoding and sending tasks, broker hops, decoding results) are counted, as the
simulator models them only as the devices' link time.

The default workload is ResNet-20 on digits (71 samples per device), 4 of 20 devices a round, 5 local
epochs: the boards need 1.4-3.5 s to train, and four concurrent trainings took 1.35-2 s of this 2-core
host while other jobs held about a core: faster than each round's slowest board, whose padding sets the
round's length (the fastest boards overran a little, off the critical path). Agents report
where the host was slower than their board ("overrun"); faster classes overrun on this host (phone-low,
21 GFLOP/s, by 1-2.5 s per task with five training at once: `--mix rpi4:0.7,phone-low:0.3 --per-round 5`).
The tiny CNN is no better: this host trains it at ~12 GFLOP/s per core, about a Pi 4's speed.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.fidelity
Ends with one line `median_abs_err=… worst_err=…` (relative errors of the fleet against the simulator).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FLEET = "fidelity"
DEFAULT_MIX = "rpi4:1"
AGENT_LINE = re.compile(
    r"round (\d+): emulating (\S+): download ([\d.]+)s, training ([\d.]+)s \(host ([\d.]+)s\), "
    r"upload ([\d.]+)s, slept ([\d.]+)s, overrun ([\d.]+)s"
)


# -- comparison (no torch, no processes: tests/benchmarks/test_fidelity.py checks it directly) -------------
def round_durations(records: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """Round → seconds from the first task sent to the round's close (metrics.jsonl records)."""
    return {int(r["round"]): float(r["closed_at"]) - float(r["dispatched_at"]) for r in records}


@dataclass(frozen=True)
class RoundError:
    round: int
    simulated_s: float
    fleet_s: float

    @property
    def error(self) -> float:
        """Relative error of the simulator's prediction against the fleet's measured round."""
        return (self.fleet_s - self.simulated_s) / self.simulated_s


def compare(simulated: Mapping[int, float], fleet: Mapping[int, float]) -> list[RoundError]:
    """Per-round errors; both runs must hold the same rounds (a missing round is a failed replay)."""
    if set(simulated) != set(fleet):
        raise ValueError(f"rounds differ: simulator {sorted(simulated)}, fleet {sorted(fleet)}")
    for r, seconds in simulated.items():
        if not seconds > 0:
            raise ValueError(f"round {r}: simulated duration {seconds} s; a replayed round takes time")
    return [RoundError(r, simulated[r], fleet[r]) for r in sorted(simulated)]


def error_summary(rows: Sequence[RoundError]) -> tuple[float, float]:
    """(median |error|, worst |error|) over the rounds."""
    errors = [abs(row.error) for row in rows]
    return statistics.median(errors), max(errors)


def final_line(rows: Sequence[RoundError]) -> str:
    median, worst = error_summary(rows)
    return f"median_abs_err={median:.3f} worst_err={worst:.3f}"


def parse_agent_log(text: str) -> dict[int, dict[str, float]]:
    """Round → what the agent's emulation did (its `emulating` log lines)."""
    rounds = {}
    for match in AGENT_LINE.finditer(text):
        values = [float(v) for v in match.groups()[2:]]
        rounds[int(match.group(1))] = dict(
            zip(("down_s", "compute_s", "host_s", "up_s", "slept_s", "overrun_s"), values, strict=True)
        )
    return rounds


def table(
    rows: Sequence[RoundError],
    devices: Mapping[int, Sequence[str]],
    slowest: Mapping[int, str],
    overrun: Mapping[int, float],
) -> str:
    lines = [
        "| round | devices | simulated (s) | fleet (s) | error | slowest device (simulated) | host overrun (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.round} | {len(devices.get(row.round, ()))} | {row.simulated_s:.3f} | {row.fleet_s:.3f} | "
            f"{row.error:+.3f} | {slowest.get(row.round, '?')} | {overrun.get(row.round, 0.0):.3f} |"
        )
    return "\n".join(lines)


# -- the two runs ----------------------------------------------------------------------------------------
def shared_config(a: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """What both worlds run: the same method, seed, participation, deadline and quorum."""
    fraction = (a.per_round + 0.5) / a.devices  # floor(fraction * devices) == per_round, free of rounding
    return {
        "run": {
            "rounds": a.rounds,
            "seed": a.seed,
            "over_selection": getattr(a, "over_selection", 1.0),
            "quorum": 1.0,
            "deadline_s": a.deadline,
            "eval_every": 1,
            "checkpoint_every": a.rounds,
        },
        "data": {"dataset": a.dataset},
        "model": {"arch": a.model},
        "method": {"name": a.method},
        "train": {
            "fraction": fraction,
            "local_epochs": a.local_epochs,
            "batch_size": a.batch,
            "lr": a.lr,
            "momentum": 0.9,
            "schedule": "constant",
        },
    }


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_simulator(
    a: argparse.Namespace, trace_path: Path, out: Path, run: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The replay of `trace_path` in `out`; `run`: more [run] keys (the server_time settings of --mixed)."""
    from nestling.config import config_from_dict
    from nestling.simulator.run import run_simulation

    shared = shared_config(a)
    cfg = config_from_dict(
        {
            **shared,
            "run": {**shared["run"], "traces": str(trace_path), "workers": 1, **(run or {})},
            "data": {**shared["data"], "clients": a.devices, "partition": "iid"},
        }
    )
    started = time.perf_counter()
    run_simulation(cfg, out, overwrite=True)
    timeline = read_jsonl(out / "timeline.jsonl")
    devices: dict[int, list[str]] = {}
    slowest: dict[int, tuple[float, str]] = {}
    for row in timeline:
        if row["outcome"] != "used":
            continue
        devices.setdefault(row["round"], []).append(row["device_id"])
        took = row["ends_at"] - row["dispatched_at"]
        if took > slowest.get(row["round"], (-1.0, ""))[0]:
            slowest[row["round"]] = (took, f"{row['device_id']} ({row['device_class']})")
    return {
        "metrics": read_jsonl(out / "metrics.jsonl"),
        "timeline": timeline,
        "durations": round_durations(read_jsonl(out / "metrics.jsonl")),
        "devices": devices,
        "slowest": {r: name for r, (_, name) in slowest.items()},
        "seconds": time.perf_counter() - started,
    }


def toml_tables(tables: Mapping[str, Mapping[str, Any]]) -> str:
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        return repr(v)

    return "".join(
        f"[{name}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in table.items() if v is not None) + "\n"
        for name, table in tables.items()
    )


def run_fleet(
    a: argparse.Namespace,
    traces: list[Any],
    trace_path: Path,
    work: Path,
    agent_flags: Sequence[str] = (),
) -> dict[str, Any]:
    from nestling.server.broker import find_free_port, wait_for_port
    from nestling.simulator.fleetdata import device_id

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    port = find_free_port()
    url = f"mqtt://127.0.0.1:{port}"
    broker_table = {"url": url, "fleet": FLEET}
    shared = shared_config(a)
    (work / "fleet.toml").write_text(
        toml_tables(
            {
                "broker": broker_table,
                "fleet": {"devices": a.devices, "registration_timeout_s": 300.0, "heartbeat_timeout_s": 60.0},
                "enrolment": {"devices": [device_id(i) for i in range(len(traces))]},
                "run": {**shared["run"], "out_dir": "fleet"},
                "data": shared["data"],
                "model": shared["model"],
                "method": shared["method"],
                "train": shared["train"],
            }
        )
    )
    processes: list[subprocess.Popen] = []
    logs = []

    def start(name: str, argv: list[str]) -> subprocess.Popen:
        log = (work / f"{name}.log").open("wb")
        logs.append(log)
        process = subprocess.Popen(
            [sys.executable, *argv], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        processes.append(process)
        return process

    started = time.perf_counter()
    try:
        start("broker", ["-m", "nestling.cli", "broker", "--port", str(port)])
        if not wait_for_port("127.0.0.1", port, 30.0):
            raise RuntimeError(f"the embedded broker did not come up; see {work / 'broker.log'}")
        for i, trace in enumerate(traces):
            config = work / f"agent-{i}.toml"
            config.write_text(
                toml_tables(
                    {
                        "broker": broker_table,
                        "device": {"id": device_id(i), "memory_budget_mb": trace.memory_budget_bytes / 2**20},
                        "data": {
                            "dataset": a.dataset,
                            "client_index": i,
                            "num_clients": a.devices,
                            "seed": a.seed,
                            "partition": "iid",
                        },
                        "agent": {"heartbeat_s": 2.0},
                    }
                )
            )
            start(
                f"agent-{i}",
                [
                    "-m",
                    "nestling.edge.agent_cli",
                    "--config",
                    str(config),
                    "--emulate-trace",
                    str(trace_path),
                    "--emulate-device",
                    trace.device_id,
                    *agent_flags,
                ],
            )
        # Let the agents finish starting (imports, data, warm-up) before the server's first round begins.
        give_up = time.monotonic() + 300
        while not all(
            "hello sent" in (work / f"agent-{i}.log").read_text(errors="replace") for i in range(len(traces))
        ):
            if time.monotonic() > give_up:
                raise RuntimeError(f"agents did not all connect within 300 s; see {work}")
            time.sleep(0.5)
        time.sleep(a.settle)
        agents_ready = time.perf_counter() - started
        server = start("server", ["-m", "nestling.server.fleet", "--config", str(work / "fleet.toml")])
        if server.wait(timeout=a.timeout) != 0:
            raise RuntimeError(f"the server failed; see {work / 'server.log'}")
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
        for log in logs:
            log.close()
    return {
        **read_fleet_run(work, len(traces)),
        "agents_ready_s": agents_ready,
        "seconds": time.perf_counter() - started,
    }


def read_fleet_run(work: Path, agents: int) -> dict[str, Any]:
    """A finished fleet run in `work`: the server's fleet/ folder and the agents' logs."""
    from nestling.simulator.fleetdata import device_id

    out = work / "fleet"
    emulation: dict[int, dict[str, dict[str, float]]] = {}
    agent_logs = {device_id(i): (work / f"agent-{i}.log").read_text(errors="replace") for i in range(agents)}
    for device, text in agent_logs.items():
        for r, figures in parse_agent_log(text).items():
            emulation.setdefault(r, {})[device] = figures
    summary = json.loads((out / "summary.json").read_text())
    return {
        "metrics": read_jsonl(out / "metrics.jsonl"),
        "agent_logs": agent_logs,
        "durations": round_durations(read_jsonl(out / "metrics.jsonl")),
        "emulation": emulation,
        "emulated": summary.get("emulated", {}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--mix", default=DEFAULT_MIX, help="board classes of the trace (catalogue names: weights)"
    )
    parser.add_argument("--model", default="resnet20")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--method", default="fedavg")
    parser.add_argument("--local-epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--deadline", type=float, default=120.0)
    parser.add_argument(
        "--seed", type=int, default=6, help="seed of the trace, partitions, selection and training"
    )
    parser.add_argument(
        "--settle", type=float, default=3.0, help="seconds between the agents' start and the server's"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="give the fleet run up to this long")
    parser.add_argument("--out", type=Path, help="keep the trace, both runs and every log here")
    parser.add_argument(
        "--mixed",
        action="store_true",
        help="four board classes with churn: dropouts, availability windows, over-selection, a deadline and "
        "time-to-accuracy (benchmarks/_fidelity_mixed.py; its own defaults, listed there)",
    )
    parser.add_argument("--over-selection", type=float, default=1.0)
    parser.add_argument("--churn", type=float, default=0.5, help="--mixed: share of devices that come and go")
    parser.add_argument(
        "--online-h", type=float, default=2.0, help="--mixed: mean online session (trace hours)"
    )
    parser.add_argument(
        "--offline-h", type=float, default=1.0, help="--mixed: mean offline gap (trace hours)"
    )
    parser.add_argument(
        "--time-scale", type=float, default=240.0, help="--mixed: trace seconds per wall second"
    )
    parser.add_argument(
        "--replay-only",
        action="store_true",
        help="--mixed: run (or reuse) only the replay in --out; a later run with the same settings reuses it",
    )
    parser.add_argument(
        "--fleet-from",
        type=Path,
        help="--mixed: compare against the fleet recorded in this earlier --out (same settings and trace) "
        "instead of running one: judges a changed simulator against a fleet measured on a quiet host",
    )
    parser.add_argument(
        "--fixed-server-s",
        type=float,
        help="--mixed: seconds a round the fixed replay's clock moves for the server (default: the fleet's mean "
        "measured time between rounds)",
    )
    parser.add_argument(
        "--transport-from",
        type=Path,
        help="--mixed: the fair replay's [run] transport_time keys from this JSON (benchmarks._fidelity_transport "
        "--out) instead of measuring them after the fleet",
    )
    parser.add_argument(
        "--target-share",
        type=float,
        default=0.9,
        help="--mixed: target accuracy = this share of the lower of both worlds' best accuracies",
    )
    if argv is None:
        argv = sys.argv[1:]
    if "--mixed" in argv:
        from benchmarks._fidelity_mixed import MIXED_DEFAULTS

        parser.set_defaults(**MIXED_DEFAULTS)
    a = parser.parse_args(argv)
    if a.mixed:
        from benchmarks._fidelity_mixed import run_mixed

        return run_mixed(a)

    from nestling.profiler.traces import save_traces
    from nestling.simulator.generate import generate_fleet

    with tempfile.TemporaryDirectory() as scratch:
        work = (a.out or Path(scratch)).resolve()
        work.mkdir(parents=True, exist_ok=True)
        trace_path = work / "fleet.jsonl"
        traces = generate_fleet(a.mix, a.devices, seed=a.seed, diurnal=False)
        save_traces(traces, trace_path)
        sim = run_simulator(a, trace_path, work / "sim")
        fleet = run_fleet(a, traces, trace_path, work)
    rows = compare(sim["durations"], fleet["durations"])
    fleet_devices = {r: sorted(by_device) for r, by_device in fleet["emulation"].items()}
    same = all(sorted(sim["devices"].get(r, [])) == fleet_devices.get(r, []) for r in sim["durations"])
    overrun = {
        r: max((f["overrun_s"] for f in by_device.values()), default=0.0)
        for r, by_device in fleet["emulation"].items()
    }
    classes = sorted({e["class"] for e in fleet["emulated"].values()})
    print(
        f"trace: {a.devices} devices ({a.mix}, seed {a.seed}, always online); {a.model} on {a.dataset}, "
        f"{a.method}, {a.per_round} devices a round, {a.local_epochs} local epochs, batch {a.batch}"
    )
    print(
        f"simulator: {sim['seconds']:.1f} s; fleet: {fleet['seconds']:.1f} s wall ({fleet['agents_ready_s']:.1f} s "
        f"starting {a.devices} agent processes); {len(fleet['emulated'])} agents emulating {', '.join(classes)}"
    )
    print(f"same devices every round in both worlds: {'yes' if same else 'NO'}")
    print(table(rows, sim["devices"], sim["slowest"], overrun))
    total_overrun = sum(
        f["overrun_s"] for by_device in fleet["emulation"].values() for f in by_device.values()
    )
    print(
        f"host overrun over all tasks: {total_overrun:.3f} s (time the host was slower than the board it emulated)"
    )
    print(
        f"mean error {statistics.mean(row.error for row in rows):+.3f} (positive: the fleet's rounds are longer)"
    )
    print(final_line(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
