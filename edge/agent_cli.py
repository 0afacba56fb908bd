"""`nestling agent --config agent.toml [--emulate CLASS]` and `nestling agent install-service`: run a board's agent.

`--emulate` resolves a board class of the simulator's catalogue (or one device of a trace) here, in the
command, so the agent itself (edge/agent.py, edge/emulation.py) only ever sees plain speed figures.
"""

from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from nestling.data import load_dataset, make_partition
from nestling.edge.agent import Agent
from nestling.edge.agent_config import AgentConfig, DataSection, DeviceSection, load_agent_config
from nestling.edge.emulation import EmulationTarget
from nestling.edge.procedures import ClientData
from nestling.edge.service import UNIT_NAME, write_unit
from nestling.errors import ConfigError, NestlingError
from nestling.log_setup import configure_logging
from nestling.plugins import load_plugins

_PARTITION_OPTIONS = {"dirichlet": ("alpha",), "balanced-dirichlet": ("alpha",), "scalefl": ("alpha",)}


def load_client_data(section: DataSection) -> ClientData:
    """This board's partition of a named dataset, rebuilt from the fleet's shared seed (no simulator needed)."""
    extra: dict[str, Any] = {} if section.limit_train is None else {"limit_train": section.limit_train}
    bundle = load_dataset(section.dataset, section.root, seed=section.seed, **extra)
    options = {name: getattr(section, name) for name in _PARTITION_OPTIONS.get(section.partition, ())}
    parts = make_partition(
        section.partition, bundle.train.y.numpy(), section.num_clients, section.seed, **options
    )
    index = parts[section.client_index]
    return ClientData(bundle.train.x[index], bundle.train.y[index], bundle.augment)


def resolve_emulation(device: DeviceSection) -> EmulationTarget | None:
    """The board `[device] emulate` / `emulate_trace` + `emulate_device` name (with its injected
    `emulate_slowdown`), or None (no emulation)."""
    target = _emulated_board(device)
    if target is None:
        return None
    windows = tuple((int(a), int(b), float(f)) for a, b, f in device.emulate_slowdown)
    return replace(target, slowdown=windows) if windows else target


def _emulated_board(device: DeviceSection) -> EmulationTarget | None:
    """The board `[device] emulate` / `emulate_trace` + `emulate_device` name, or None (no emulation).

    The board catalogue and the trace format are the profiler's (read lazily: an agent that does not
    emulate never imports them)."""
    if device.emulate is not None:
        from nestling.profiler.catalogue import BOARDS

        board = BOARDS.get(device.emulate)
        if board is None:
            raise ConfigError(
                f"--emulate / [device] emulate: unknown board class '{device.emulate}' "
                f"(known: {', '.join(BOARDS)})"
            )
        return EmulationTarget.of_board(board)
    if device.emulate_trace is not None:
        from nestling.profiler.traces import load_traces

        traces = {trace.device_id: trace for trace in load_traces(device.emulate_trace)}
        trace = traces.get(str(device.emulate_device))
        if trace is None:
            known = ", ".join(list(traces)[:10]) + (", ..." if len(traces) > 10 else "")
            raise ConfigError(
                f"--emulate-device: no device '{device.emulate_device}' in trace "
                f"{device.emulate_trace} (it has {len(traces)}: {known})"
            )
        try:
            return EmulationTarget.of_trace(trace)
        except ValueError as exc:
            raise ConfigError(f"--emulate-device {trace.device_id}: {exc}") from None
    return None


def apply_emulation_flags(
    config: AgentConfig, emulate: str | None, trace: Path | None, device_id: str | None
) -> None:
    """Command-line --emulate / --emulate-trace + --emulate-device replace what agent.toml says."""
    if emulate is not None and (trace is not None or device_id is not None):
        raise ConfigError(
            "--emulate (a board class) and --emulate-trace/--emulate-device (a trace device) "
            "exclude each other"
        )
    if (trace is None) != (device_id is None):
        raise ConfigError(
            "--emulate-trace and --emulate-device go together (a trace file and a device_id in it)"
        )
    device = config.device
    if emulate is not None:
        device.emulate, device.emulate_trace, device.emulate_device = emulate, None, None
    elif trace is not None:
        device.emulate, device.emulate_trace, device.emulate_device = None, str(trace), device_id


def with_availability(
    emulation: EmulationTarget | None, device: DeviceSection, time_scale: float | None
) -> EmulationTarget | None:
    """`--emulate-availability [--emulate-time-scale S]`: the emulated trace device also leaves and returns as
    its windows say, its clock running S trace seconds a wall second (edge/emulated_availability.py)."""
    if emulation is None or emulation.trace_device is None or device.emulate_trace is None:
        raise ConfigError(
            "--emulate-availability needs --emulate-trace and --emulate-device (the windows are a trace's)"
        )
    from nestling.profiler.traces import load_traces, time_scaled

    trace = next(t for t in load_traces(device.emulate_trace) if t.device_id == emulation.trace_device)
    try:
        scaled = time_scaled(trace, 1.0 if time_scale is None else time_scale)
    except ConfigError as exc:
        raise ConfigError(f"--emulate-time-scale: {exc}") from None
    return replace(emulation, availability=scaled)


def _run(
    config_path: Path,
    emulate: str | None = None,
    emulate_trace: Path | None = None,
    emulate_device: str | None = None,
    availability: bool = False,
    time_scale: float | None = None,
) -> int:
    config = load_agent_config(config_path)
    apply_emulation_flags(config, emulate, emulate_trace, emulate_device)
    emulation = resolve_emulation(config.device)
    if time_scale is not None and not availability:
        raise ConfigError(
            "--emulate-time-scale scales the availability windows: give --emulate-availability too"
        )
    if availability:
        emulation = with_availability(emulation, config.device, time_scale)
    torch.set_num_threads(config.device.threads)  # more threads than cores collapses training throughput
    data = load_client_data(config.data)
    agent = Agent(config, data, emulation=emulation).start()
    signal.signal(signal.SIGTERM, lambda *_: agent.request_stop())  # the main thread leaves cleanly
    signal.signal(signal.SIGINT, lambda *_: agent.request_stop())
    emulating = (
        ""
        if emulation is None
        else f", emulating {emulation.name}"
        + (f" (trace device {emulation.trace_device})" if emulation.trace_device else "")
    )
    print(
        f"agent {config.device.id}: {len(data)} samples, broker {config.broker.url}, fleet "
        f"{config.broker.fleet}{emulating}",
        flush=True,
    )
    while not agent.wait(1.0):
        pass
    agent.stop()
    memory = agent.monitor.memory.reading()
    print(
        f"agent {config.device.id}: peak resident memory {memory.peak_rss_bytes / 2**20:.0f} MiB, "
        f"now {memory.rss_bytes / 2**20:.0f} MiB ({memory.source})",
        flush=True,
    )
    return 0


def agent_main(argv: list[str]) -> int:
    """`nestling agent --config agent.toml [--emulate CLASS | --emulate-trace T --emulate-device ID]` |
    `nestling agent install-service --config agent.toml [--out P]`."""
    parser = argparse.ArgumentParser(
        prog="nestling agent", description="Run this board's federated-learning agent."
    )
    parser.add_argument("action", nargs="?", choices=("run", "install-service"), default="run")
    parser.add_argument("--config", type=Path, required=True, help="agent.toml (see examples/agent.toml)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("/etc/systemd/system"),
        help=f"install-service: where to write {UNIT_NAME} (default /etc/systemd/system)",
    )
    parser.add_argument(
        "--user", default=None, help="install-service: account the agent runs as (default: you)"
    )
    parser.add_argument(
        "--emulate",
        metavar="CLASS",
        default=None,
        help="behave like a slower board of the catalogue (rpi4, phone-low, ...): compute padded "
        "to its speed, transfers paced to its link (overrides [device] emulate)",
    )
    parser.add_argument(
        "--emulate-trace",
        metavar="TRACE",
        type=Path,
        default=None,
        help="emulate one device of this trace file instead (with --emulate-device)",
    )
    parser.add_argument(
        "--emulate-device", metavar="ID", default=None, help="the trace's device_id to emulate"
    )
    parser.add_argument(
        "--emulate-availability",
        action="store_true",
        help="with --emulate-trace: leave the broker and return as the trace device's availability windows "
        "say (its clock starts at the fleet's first round); a task held when leaving is abandoned",
    )
    parser.add_argument(
        "--emulate-time-scale",
        metavar="S",
        type=float,
        default=None,
        help="run the trace's clock S times faster than the wall clock (a day of windows in 86400/S s)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="INFO (default) says what the agent waits for and does; DEBUG adds every message",
    )
    args = parser.parse_args(argv)
    configure_logging(
        args.log_level, "%(asctime)s %(name)s %(levelname)s %(message)s", force=True
    )  # the top-level CLI configured WARNING already
    try:
        load_plugins()  # $NESTLING_PLUGINS (also when started as python -m nestling.edge.agent_cli)
        if args.action == "install-service":
            load_agent_config(args.config)  # refuse to install a unit that would fail at boot
            path = write_unit(args.config, args.out, user=args.user)
            print(
                f"wrote {path}\nenable it: sudo systemctl daemon-reload && sudo systemctl enable --now {UNIT_NAME}"
            )
            return 0
        return _run(
            args.config,
            args.emulate,
            args.emulate_trace,
            args.emulate_device,
            args.emulate_availability,
            args.emulate_time_scale,
        )
    except NestlingError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(agent_main(sys.argv[1:]))
