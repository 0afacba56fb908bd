"""`nestling demo`: an embedded broker, a server and four agent processes with different memory budgets.

Each budget buys a different NeFL-WD submodel (the strategy sizes by budget with profiler/planner.py),
so one command shows the whole deployment path — registration, chunked tasks, training on four
"boards", nested aggregation — and ends with the per-submodel accuracy table. Nothing to install.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from nestling.errors import NestlingError
from nestling.server.broker import EmbeddedBroker
from nestling.server.fleet import run_fleet
from nestling.server.fleet_config import load_fleet_config

FLEET = "demo"
BUDGETS_MB = (
    9,
    12,
    16,
    24,
)  # ResNet-20 on 16x16 digits, batch 32: the planner puts k1..k5 at 8.5/10.3/15.9/17.2/17.7 MB


def fleet_toml(url: str, args: argparse.Namespace) -> str:
    return textwrap.dedent(f"""\
        [broker]
        url = "{url}"
        fleet = "{FLEET}"
        [fleet]
        devices = {len(BUDGETS_MB)}
        registration_timeout_s = 180
        [run]
        rounds = {args.rounds}
        deadline_s = 300
        out_dir = "out"
        [data]
        dataset = "digits"
        [model]
        arch = "{args.model}"
        [method]
        name = "nefl-wd"
        flex = 0  # a board trains exactly the submodel its budget buys, never a larger one
        [train]
        fraction = 1.0
        local_epochs = {args.local_epochs}
        batch_size = 32
        lr = {args.lr}
        momentum = 0.9
        schedule = "constant"
        """)


def agent_toml(url: str, index: int, budget_mb: int) -> str:
    return textwrap.dedent(f"""\
        [broker]
        url = "{url}"
        fleet = "{FLEET}"
        [device]
        id = "board-{index}"
        memory_budget_mb = {budget_mb}
        [data]
        dataset = "digits"
        client_index = {index}
        num_clients = {len(BUDGETS_MB)}
        [agent]
        heartbeat_s = 2.0
        """)


def start_agents(url: str, work: Path) -> list[subprocess.Popen]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one torch thread per board process
    agents = []
    for index, budget in enumerate(BUDGETS_MB):
        config = work / f"agent-{index}.toml"
        config.write_text(agent_toml(url, index, budget))
        with (work / f"agent-{index}.log").open("wb") as log:
            agents.append(
                subprocess.Popen(
                    [sys.executable, "-m", "nestling", "agent", "--config", str(config)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return agents


def stop_agents(agents: list[subprocess.Popen]) -> None:
    for agent in agents:
        agent.terminate()
    for agent in agents:
        try:
            agent.wait(15)
        except subprocess.TimeoutExpired:
            agent.kill()


def print_table(summary: dict[str, Any]) -> None:
    """Per-submodel accuracy, size and which boards trained it."""
    budgets = {f"board-{i}": mb for i, mb in enumerate(BUDGETS_MB)}
    table = Table(
        title=f"NeFL-WD on a 4-board fleet · {summary['model']} · digits · {summary['rounds']} rounds"
    )
    for column in ("submodel", "parameters", "MACs", "test accuracy", "trained by"):
        table.add_column(column, justify="left" if column in ("submodel", "trained by") else "right")
    trained = []
    for sub in summary["submodels"]:
        boards = ", ".join(
            f"{d} ({budgets.get(d, '?')} MB)" for d in summary["trained_by"].get(sub["id"], [])
        )
        if boards:
            trained.append(sub["accuracy"])
        table.add_row(
            sub["name"],
            f"{sub['parameters']:,}",
            f"{sub['macs']:,}",
            f"{100 * sub['accuracy']:.1f}%",
            boards or "no board's budget lands here",
        )
    console = Console()
    console.print(table)
    transport = summary["transport"]
    rejected = sum(v for k, v in transport.items() if k.startswith("rejected_"))
    if trained:
        console.print(
            f"trained submodels: worst {100 * min(trained):.1f}%, average "
            f"{100 * sum(trained) / len(trained):.1f}% · {transport.get('accepted', 0)}/"
            f"{transport.get('dispatched', 0)} results accepted, {rejected} rejected · "
            f"{summary['wall_seconds']:.0f} s"
        )


def demo_main(argv: list[str]) -> int:
    """`nestling demo [--rounds N] [--model resnet20] [--out DIR]`."""
    parser = argparse.ArgumentParser(prog="nestling demo", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--model", default="resnet20", help="any zoo model with a NeFL family (tinycnn is faster)"
    )
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=Path("runs/demo-fleet"))
    args = parser.parse_args(argv)
    work = args.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        with EmbeddedBroker() as broker:
            (work / "fleet.toml").write_text(fleet_toml(broker.url, args))
            print(
                f"embedded broker on {broker.url}; boards with {', '.join(map(str, BUDGETS_MB))} MB budgets; "
                f"logs in {work}",
                flush=True,
            )
            agents = start_agents(broker.url, work)
            try:
                summary = run_fleet(load_fleet_config(work / "fleet.toml"))
            finally:
                stop_agents(agents)
    except NestlingError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print_table(summary)
    print(
        f"demo finished in {time.perf_counter() - started:.0f} s; metrics, checkpoints and accuracy.png in "
        f"{work / 'out'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(demo_main(sys.argv[1:]))
