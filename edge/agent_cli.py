"""`nestling agent --config agent.toml` and `nestling agent install-service`: run a board's agent."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from edge.agent import Agent
from edge.agent_config import DataSection, load_agent_config
from edge.procedures import ClientData
from edge.service import UNIT_NAME, write_unit
from nestling.data import load_dataset, make_partition
from nestling.errors import NestlingError

_PARTITION_OPTIONS = {"dirichlet": ("alpha",), "balanced-dirichlet": ("alpha",), "scalefl": ("alpha",)}


def load_client_data(section: DataSection) -> ClientData:
    """This board's partition of a named dataset, rebuilt from the fleet's shared seed (no simulator needed)."""
    extra: dict[str, Any] = {} if section.limit_train is None else {"limit_train": section.limit_train}
    bundle = load_dataset(section.dataset, section.root, seed=section.seed, **extra)
    options = {name: getattr(section, name) for name in _PARTITION_OPTIONS.get(section.partition, ())}
    parts = make_partition(section.partition, bundle.train.y.numpy(), section.num_clients, section.seed, **options)
    index = parts[section.client_index]
    return ClientData(bundle.train.x[index], bundle.train.y[index], bundle.augment)


def _run(config_path: Path) -> int:
    config = load_agent_config(config_path)
    torch.set_num_threads(config.device.threads)  # more threads than cores collapses training throughput
    data = load_client_data(config.data)
    agent = Agent(config, data).start()
    signal.signal(signal.SIGTERM, lambda *_: agent.request_stop())  # the main thread leaves cleanly
    signal.signal(signal.SIGINT, lambda *_: agent.request_stop())
    print(f"agent {config.device.id}: {len(data)} samples, broker {config.broker.url}, fleet "
          f"{config.broker.fleet}", flush=True)
    while not agent.wait(1.0):
        pass
    agent.stop()
    return 0


def agent_main(argv: list[str]) -> int:
    """`nestling agent --config agent.toml` | `nestling agent install-service --config agent.toml [--out P]`."""
    parser = argparse.ArgumentParser(prog="nestling agent", description="Run this board's federated-learning agent.")
    parser.add_argument("action", nargs="?", choices=("run", "install-service"), default="run")
    parser.add_argument("--config", type=Path, required=True, help="agent.toml (see examples/agent.toml)")
    parser.add_argument("--out", type=Path, default=Path("/etc/systemd/system"),
                        help=f"install-service: where to write {UNIT_NAME} (default /etc/systemd/system)")
    parser.add_argument("--user", default=None, help="install-service: account the agent runs as (default: you)")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.action == "install-service":
            load_agent_config(args.config)  # refuse to install a unit that would fail at boot
            path = write_unit(args.config, args.out, user=args.user)
            print(f"wrote {path}\nenable it: sudo systemctl daemon-reload && sudo systemctl enable --now {UNIT_NAME}")
            return 0
        return _run(args.config)
    except NestlingError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(agent_main(sys.argv[1:]))
