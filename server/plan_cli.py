"""`nestling plan`: turn fleet budgets (profiles or numbers) into each method's submodels or depth plans.

It lives in server/ because it asks the strategies for their submodel families; the profiler below it
supplies the estimator and the fitting rules."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from nestling.cli_numbers import non_negative_float, positive_float, positive_int, share
from nestling.errors import NestlingError
from nestling.models.zoo import known_models
from nestling.profiler.cli import MIB, _console, _write_json
from nestling.profiler.planner import DeviceBudget, PlanRow, plan_to_json


def _plan_parser() -> argparse.ArgumentParser:
    from nestling.server.plan_methods import plannable_methods

    p = argparse.ArgumentParser(
        prog="nestling plan", description="Turn device budgets into submodels or stages."
    )
    p.add_argument("profiles", nargs="*", type=Path, help="device profiles written by `nestling profile`")
    p.add_argument(
        "--budget-mb",
        type=positive_float,
        nargs="+",
        help="memory budgets (MiB): one per profile, several for one profile (that board at each budget), "
        "or devices of their own without profiles",
    )
    p.add_argument("--method", choices=sorted(plannable_methods()), help="required without --fleet")
    p.add_argument("--model", choices=known_models(), help="required without --fleet")
    p.add_argument(
        "--fleet",
        type=Path,
        metavar="RUN_DIR",
        help="a fleet run's out_dir: what its server would assign next to the boards in its registry.json",
    )
    p.add_argument(
        "--deadline",
        type=positive_float,
        help="--fleet: plan for this round deadline (s) instead of the run's",
    )
    p.add_argument("--train-share", type=share, help="--fleet: share of the deadline planned for training")
    p.add_argument(
        "--batch", type=positive_int, help="training batch (default: the first profile's, else 32)"
    )
    p.add_argument(
        "--classes", type=positive_int, default=10, help="classes of the model's head (default 10)"
    )
    p.add_argument("--image-size", type=positive_int, default=32, help="input side in pixels (default 32)")
    p.add_argument("--in-channels", type=positive_int, default=3, help="input channels (default 3)")
    p.add_argument("--step-ms", type=positive_float, help="time budget per training step")
    p.add_argument(
        "--memory-fraction",
        type=share,
        default=0.5,
        help="share of a profile's available memory used when it records no budget",
    )
    p.add_argument(
        "--levels",
        type=positive_int,
        default=4,
        help="ScaleFL: number of complexity levels (k-means clusters)",
    )
    p.add_argument("--tolerance", type=non_negative_float, default=0.05, help="FeDepth τ / ScaleFL ε")
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help='a [method] option, e.g. budgets="lack"',
    )
    p.add_argument("--out", type=Path, help="write the plan as JSON (default plan.json; --fleet: none)")
    return p


def _devices(args: argparse.Namespace) -> tuple[list[DeviceBudget], int | None]:
    budgets = args.budget_mb or []
    profiles = []
    for path in args.profiles:
        if not path.is_file():
            raise NestlingError(f"profile {path} does not exist")
        profiles.append(json.loads(path.read_text()))
    if len(profiles) == 1 and len(budgets) > 1:  # one measured board, planned at each budget
        devices = []
        for mb in budgets:
            board = DeviceBudget.from_profile(
                profiles[0], memory_bytes=int(mb * MIB), step_ms_budget=args.step_ms
            )
            devices.append(replace(board, name=f"{board.name}@{mb:g}MiB"))
        return devices, int(profiles[0]["model"]["batch"]) if "model" in profiles[0] else None
    if profiles and budgets and len(budgets) != len(profiles):
        raise NestlingError(
            f"--budget-mb has {len(budgets)} values for {len(profiles)} profiles: give one per profile, "
            "or several with one profile"
        )
    if profiles:
        devices = [
            DeviceBudget.from_profile(
                p,
                memory_bytes=int(budgets[i] * MIB) if budgets else None,
                memory_fraction=args.memory_fraction,
                step_ms_budget=args.step_ms,
            )
            for i, p in enumerate(profiles)
        ]
        batch = next((int(p["model"]["batch"]) for p in profiles if "model" in p), None)
        return devices, batch
    return [
        DeviceBudget(f"budget-{i + 1}", int(mb * MIB), step_ms_budget=args.step_ms)
        for i, mb in enumerate(budgets)
    ], None


def _parse_options(pairs: list[str]) -> dict[str, Any]:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise NestlingError(f"--option expects KEY=VALUE, got '{pair}'")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def _plan_table(method: str, rows: list[PlanRow]) -> Table:
    table = Table(title=f"plan · {method}")
    for column in (
        "device",
        "budget MiB",
        "plan",
        "params",
        "GMACs/step",
        "est. MiB",
        "est. step ms",
        "fits",
    ):
        table.add_column(column, justify="left" if column in ("device", "plan") else "right")
    for r in rows:
        table.add_row(
            r.device,
            f"{r.budget_bytes / MIB:.1f}",
            r.label,
            f"{r.params:,}",
            f"{r.training_macs / 1e9:.2f}",
            f"{r.memory_bytes / MIB:.1f}",
            "–" if r.step_ms is None else f"{r.step_ms:.1f}",
            "[green]yes[/green]" if r.fits else "[red]no[/red]",
        )
    return table


def _fleet_table(plan: dict[str, Any]) -> Table:
    budget = plan["time_budget_s"]
    table = Table(
        title=f"next round ({plan['round'] + 1}) of {plan['run']} · {plan['method']} · {plan['model']} · "
        f"training time allowed: {'none' if budget is None else f'{budget:.2f} s'}"
    )
    for column in ("device", "submodel", "reason", "est. MiB", "budget MiB", "predicted s", "speed", "note"):
        table.add_column(
            column, justify="left" if column in ("device", "submodel", "reason", "note") else "right"
        )
    for r in plan["devices"]:
        table.add_row(
            r["device"],
            r["submodel"],
            r["reason"],
            f"{r['memory_bytes'] / MIB:.1f}",
            "–" if r["budget_bytes"] is None else f"{r['budget_bytes'] / MIB:.1f}",
            "–" if r["predicted_s"] is None else f"{r['predicted_s']:.2f}",
            "–" if r["speed"] is None else f"{r['speed']:.2f}",
            "" if r["replan_from"] is None else f"re-plan from {r['replan_from'][:8]}",
        )
    return table


def fleet_plan_main(args: argparse.Namespace) -> int:
    """`nestling plan --fleet RUN_DIR [--deadline S] [--train-share X] [--out plan.json]`."""
    from nestling.server.fleet_plan import fleet_plan, fleet_plan_json, load_run_strategy, registered_devices

    console = _console()
    try:
        strategy, round_index, source = load_run_strategy(
            args.fleet, deadline_s=args.deadline, train_share=args.train_share
        )
        rows = fleet_plan(strategy, registered_devices(args.fleet), round_index)
    except (NestlingError, ValueError) as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        return 2
    plan = fleet_plan_json(args.fleet, strategy, round_index, source, rows)
    console.print(_fleet_table(plan))
    console.print(f"planned from {source} and registry.json")
    if args.out is not None:
        _write_json(args.out, plan)
        console.print(f"plan written to {args.out}")
    return 0


def plan_main(argv: list[str]) -> int:
    """`nestling plan PROFILE... [--budget-mb ...] --method M --model M --out plan.json` |
    `nestling plan --fleet RUN_DIR`."""
    from nestling.server.plan_methods import plan_rows

    parser = _plan_parser()
    args = parser.parse_args(argv)
    if args.fleet is not None:
        if args.profiles or args.budget_mb:
            parser.error("--fleet plans the run's registered boards: give no profiles or --budget-mb")
        return fleet_plan_main(args)
    if args.method is None or args.model is None:
        parser.error("--method and --model are required (or --fleet RUN_DIR)")
    if args.deadline is not None or args.train_share is not None:
        parser.error("--deadline and --train-share go with --fleet")
    args.out = args.out or Path("plan.json")
    console = _console()
    try:
        devices, profile_batch = _devices(args)
        batch = args.batch or profile_batch or 32
        rows, extra = plan_rows(
            args.method,
            args.model,
            devices,
            batch=batch,
            shape=(args.in_channels, args.image_size, args.image_size),
            classes=args.classes,
            levels=args.levels,
            tolerance=args.tolerance,
            options=_parse_options(args.option),
        )
    except (NestlingError, ValueError) as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        return 2
    _write_json(args.out, plan_to_json(args.method, rows, batch, model=args.model, **extra))
    console.print(_plan_table(args.method, rows))
    for key, value in extra.get("strategy_options", {}).items():  # how to train exactly this plan
        console.print(f"train these levels: --set method.{key}='{json.dumps(value)}'", soft_wrap=True)
    console.print(f"plan written to {args.out}")
    return 0
