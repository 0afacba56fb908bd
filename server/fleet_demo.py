"""`nestling demo`: an embedded broker, a server and four agent processes emulating four unequal boards.

No budget is typed anywhere: each agent emulates a board class (`[device] emulate`), reports that class's
profile in its hello (edge/self_profile.py), and the server gives each board the largest NeFL-WD submodel whose
training memory fits what the board reported and whose predicted training time fits the round's training budget
(profiler/fit.py) — four classes, four submodels, and the reason for each. One command shows the whole
deployment path — registration, profiles, chunked tasks, training on four "boards", nested aggregation,
predicted vs observed training time — and ends with the per-submodel accuracy table. Nothing to install.
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

from nestling.cli_numbers import positive_float, positive_int
from nestling.errors import NestlingError
from nestling.numbers import headline, percent, seconds
from nestling.plugins import ENV as PLUGINS_ENV
from nestling.profiler.demo_boards import DEMO_BOARDS
from nestling.run_folder import run_artifacts
from nestling.server.broker import EmbeddedBroker
from nestling.server.fleet import run_fleet
from nestling.server.fleet_config import load_fleet_config
from nestling.server.plan_summary import print_plan_table

FLEET = "demo"
BOARD_CLASSES = tuple(board.name for board in DEMO_BOARDS)  # slowest first; profiler/demo_boards.py
# Seconds of local training the planner allots per sample trained. ResNet-20 on 16x16 digits, batch 32: the
# classes' profiles then put demo-slow on k1 and demo-medium on k2 (time-bound), demo-fast-lowmem on k3
# (memory-bound: 16.8 MiB reported) and demo-fast on the full model; each keeps its submodel until the host
# runs it over 1.4x slower than its class. Every prediction is linear in the samples, so the plan does not
# depend on --local-steps.
PLAN_S_PER_SAMPLE = 0.029
# The collection deadline is generous (a loaded CI host, torch warm-up on the first task): the plan targets
# PLAN_S_PER_SAMPLE x samples of training through [run] train_share, the round waits for up to DEADLINE_S.
DEADLINE_S = 30.0
MODULE = "nestling.profiler.demo_boards"


def train_share(local_steps: int, batch: int = 32) -> float:
    """[run] train_share that gives PLAN_S_PER_SAMPLE seconds per sample trained within DEADLINE_S."""
    if local_steps < 1:
        raise NestlingError(f"--local-steps must be >= 1, got {local_steps}")
    share = PLAN_S_PER_SAMPLE * local_steps * batch / DEADLINE_S
    if share > 1:
        raise NestlingError(
            f"--local-steps {local_steps} plans more training than the {DEADLINE_S:.0f} s deadline"
        )
    return round(share, 6)


def fleet_toml(url: str, args: argparse.Namespace) -> str:
    return textwrap.dedent(f"""\
        [broker]
        url = "{url}"
        fleet = "{FLEET}"
        [fleet]
        devices = {len(BOARD_CLASSES)}
        registration_timeout_s = 180
        [enrolment]  # the demo's four boards, nobody else (their order is their index)
        devices = [{", ".join(f'"board-{i}"' for i in range(len(BOARD_CLASSES)))}]
        [run]
        rounds = {args.rounds}
        deadline_s = {DEADLINE_S}
        train_share = {train_share(args.local_steps)}
        out_dir = "out"
        [data]
        dataset = "digits"
        [model]
        arch = "{args.model}"
        [method]
        name = "nefl-wd"
        flex = 0  # a board trains exactly the submodel it is sized to, never a larger one
        [train]
        fraction = 1.0
        local_steps = {args.local_steps}
        batch_size = 32
        lr = {args.lr}
        momentum = 0.9
        schedule = "constant"
        """)


def agent_toml(url: str, index: int, board: str) -> str:
    return textwrap.dedent(f"""\
        [broker]
        url = "{url}"
        fleet = "{FLEET}"
        [device]
        id = "board-{index}"
        emulate = "{board}"
        [data]
        dataset = "digits"
        client_index = {index}
        num_clients = {len(BOARD_CLASSES)}
        [agent]
        heartbeat_s = 2.0
        """)


def start_agents(url: str, work: Path) -> list[subprocess.Popen]:
    plugins = ",".join(filter(None, (os.environ.get(PLUGINS_ENV, ""), MODULE)))  # the demo classes
    env = {**os.environ, "OMP_NUM_THREADS": "1", PLUGINS_ENV: plugins}  # one torch thread per board process
    agents = []
    for index, board in enumerate(BOARD_CLASSES):
        config = work / f"agent-{index}.toml"
        config.write_text(agent_toml(url, index, board))
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
    classes = {f"board-{i}": name for i, name in enumerate(BOARD_CLASSES)}
    table = Table(
        title=f"NeFL-WD on a 4-board fleet · {summary['model']} · digits · {summary['rounds']} rounds"
    )
    for column in ("submodel", "parameters", "MACs", "test accuracy", "trained by"):
        table.add_column(column, justify="left" if column in ("submodel", "trained by") else "right")
    trained = []
    for sub in summary["submodels"]:
        boards = ", ".join(f"{d} ({classes.get(d, '?')})" for d in summary["trained_by"].get(sub["id"], []))
        if boards:
            trained.append(sub["accuracy"])
        table.add_row(
            sub["name"],
            f"{sub['parameters']:,}",
            f"{sub['macs']:,}",
            percent(sub["accuracy"]),
            boards or "no board is sized to it",
        )
    console = Console()
    console.print(table)
    print_plan_table(summary, console, classes)
    transport = summary["transport"]
    rejected = sum(v for k, v in transport.items() if k.startswith("rejected_"))
    deadline = summary.get("config", {}).get("run", {}).get("deadline_s")
    console.print(
        f"{headline(summary)} over all {len(summary['submodels'])} submodels (summary.json; "
        f"{len(trained)} trained by a board) · round deadline {seconds(deadline)} s · "
        f"{transport.get('accepted', 0)}/{transport.get('dispatched', 0)} results accepted, {rejected} rejected · "
        f"{summary['wall_seconds']:.0f} s"
    )


def demo_main(argv: list[str]) -> int:
    """`nestling demo [--rounds N] [--model resnet20] [--out DIR]`."""
    parser = argparse.ArgumentParser(prog="nestling demo", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive_int, default=6, help="communication rounds (default 6)")
    parser.add_argument(
        "--model", default="resnet20", help="any zoo model with a NeFL family (tinycnn is faster)"
    )
    parser.add_argument("--local-steps", type=positive_int, default=5, help="SGD steps per board per round")
    parser.add_argument(
        "--lr", type=positive_float, default=0.05, help="boards' learning rate (default 0.05)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("runs/demo-fleet"),
        help="folder for fleet.toml, agent logs and the run in out/ (default runs/demo-fleet)",
    )
    args = parser.parse_args(argv)
    work = args.out.resolve()
    if run_artifacts(work / "out"):  # the demo's folder is its own: each demo is a fresh run
        print(f"replacing the previous demo run in {work / 'out'}", flush=True)
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        with EmbeddedBroker() as broker:
            (work / "fleet.toml").write_text(fleet_toml(broker.url, args))
            print(
                f"embedded broker on {broker.url}; boards emulating {', '.join(BOARD_CLASSES)} (no budgets: "
                "each is sized by the profile it reports); "
                f"logs in {work}",
                flush=True,
            )
            agents = start_agents(broker.url, work)
            try:
                summary = run_fleet(load_fleet_config(work / "fleet.toml"), overwrite=True)
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
