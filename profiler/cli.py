"""`nestling profile` and `nestling plan`: measure this board, then turn fleet budgets into training plans."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from nestling.errors import NestlingError
from nestling.models.config import ModelConfig
from nestling.models.zoo import known_models
from nestling.spec import SubmodelSpec
from profiler.device import device_info
from profiler.measure import profile_model
from profiler.planner import DeviceBudget, PlanRow, plan_to_json

MIB = 2 ** 20


def _console() -> Console:
    """Wide tables even when piped (rich would fold them to 80 columns)."""
    return Console() if sys.stdout.isatty() else Console(width=160)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def _profile_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nestling profile", description="Measure training cost per block on this machine.")
    p.add_argument("--model", choices=known_models(), help="architecture (or give --spec)")
    p.add_argument("--spec", type=Path, help="JSON SubmodelSpec to profile instead of --model/--width")
    p.add_argument("--width", type=float, default=1.0, help="channel ratio of the profiled submodel")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--in-channels", type=int, default=3)
    p.add_argument("--norm-stats", default="running", choices=("running", "batch"))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--name", help="device name recorded in the profile (default: host name)")
    p.add_argument("--budget-mb", type=float, help="memory this device may spend on training, recorded for planning")
    p.add_argument("--gflops-seconds", type=float, default=1.0, help="duration of the sustained matmul test")
    p.add_argument("--out", type=Path, default=Path("profile.json"))
    return p


def _spec_from_args(args: argparse.Namespace) -> SubmodelSpec:
    if args.spec is not None:
        if not args.spec.is_file():
            raise NestlingError(f"spec file {args.spec} does not exist")
        return SubmodelSpec.from_dict(json.loads(args.spec.read_text()))
    if args.model is None:
        raise NestlingError("give --model or --spec")
    model = ModelConfig(args.model, num_classes=args.classes, in_channels=args.in_channels,
                        image_size=args.image_size, norm_stats=args.norm_stats)
    return SubmodelSpec(model, width=args.width)


def _profile_table(profile: dict[str, Any]) -> Table:
    table = Table(title=f"{profile['model']['arch']} · batch {profile['model']['batch']} · {profile['model']['device']}")
    for column in ("part", "params", "fwd ms (p50/p90)", "bwd ms (p50/p90)", "activations MiB", "training MiB"):
        table.add_column(column, justify="left" if column == "part" else "right")
    for part in profile["parts"]:
        f, b, m = part["forward_ms"], part["backward_ms"], part["memory"]
        table.add_row(part["name"], f"{part['params']:,}", f"{f['median']:.2f}/{f['p90']:.2f}",
                      f"{b['median']:.2f}/{b['p90']:.2f}", f"{m['activations_bytes'] / MIB:.2f}",
                      f"{m['training_bytes'] / MIB:.2f}")
    total = profile["total"]
    table.add_row("[b]whole step", "", f"{total['step_ms']['median']:.1f}/{total['step_ms']['p90']:.1f}", "",
                  f"{total['activations_bytes'] / MIB:.2f}", f"{total['peak_training_bytes'] / MIB:.2f}")
    return table


def profile_main(argv: list[str]) -> int:
    """`nestling profile --model M --batch B [--spec FILE] [--width W] --out profile.json`."""
    args = _profile_parser().parse_args(argv)
    console = _console()
    try:
        spec = _spec_from_args(args)
        torch.set_num_threads(max(1, torch.get_num_threads()))
        device = device_info(args.device, args.gflops_seconds)
        measured = profile_model(spec, args.batch, args.device, args.repeats, args.warmup)
    except (NestlingError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    profile = {"schema": measured.pop("schema"), "created": dt.datetime.now(dt.timezone.utc).isoformat(),
               "name": args.name or device["hostname"], "device": device, **measured,
               "budget": {"memory_bytes": int(args.budget_mb * MIB)} if args.budget_mb else None}
    _write_json(args.out, profile)
    console.print(_profile_table(profile))
    rss = profile["total"]["rss"]
    if rss:
        console.print(f"RSS growth over a forward pass: {rss['forward_delta_bytes'] / MIB:.1f} MiB "
                      f"({rss['ratio_to_activations']:.2f}× the metered activations)")
    console.print(f"sustained {device['compute']['gflops']:.1f} GFLOP/s · profile written to {args.out}")
    return 0


def _plan_parser() -> argparse.ArgumentParser:
    from profiler.plan_methods import PLANNABLE

    p = argparse.ArgumentParser(prog="nestling plan", description="Turn device budgets into submodels or stages.")
    p.add_argument("profiles", nargs="*", type=Path, help="device profiles written by `nestling profile`")
    p.add_argument("--budget-mb", type=float, nargs="+", help="memory budgets: one per profile, or devices of their own")
    p.add_argument("--method", required=True, choices=PLANNABLE)
    p.add_argument("--model", required=True, choices=known_models())
    p.add_argument("--batch", type=int, help="training batch (default: the first profile's, else 32)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--in-channels", type=int, default=3)
    p.add_argument("--step-ms", type=float, help="time budget per training step")
    p.add_argument("--memory-fraction", type=float, default=0.5,
                   help="share of a profile's available memory used when it records no budget")
    p.add_argument("--levels", type=int, default=4, help="ScaleFL: number of complexity levels (k-means clusters)")
    p.add_argument("--tolerance", type=float, default=0.05, help="FeDepth τ / ScaleFL ε")
    p.add_argument("--option", action="append", default=[], metavar="KEY=JSON", help="a [method] option, e.g. budgets=\"lack\"")
    p.add_argument("--out", type=Path, default=Path("plan.json"))
    return p


def _devices(args: argparse.Namespace) -> tuple[list[DeviceBudget], int | None]:
    budgets = args.budget_mb or []
    profiles = []
    for path in args.profiles:
        if not path.is_file():
            raise NestlingError(f"profile {path} does not exist")
        profiles.append(json.loads(path.read_text()))
    if profiles and budgets and len(budgets) != len(profiles):
        raise NestlingError(f"--budget-mb has {len(budgets)} values for {len(profiles)} profiles")
    if profiles:
        devices = [DeviceBudget.from_profile(p, memory_bytes=int(budgets[i] * MIB) if budgets else None,
                                             memory_fraction=args.memory_fraction, step_ms_budget=args.step_ms)
                   for i, p in enumerate(profiles)]
        batch = next((int(p["model"]["batch"]) for p in profiles if "model" in p), None)
        return devices, batch
    return [DeviceBudget(f"budget-{i + 1}", int(mb * MIB), step_ms_budget=args.step_ms) for i, mb in enumerate(budgets)], None


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
    for column in ("device", "budget MiB", "plan", "params", "GMACs/step", "est. MiB", "est. step ms", "fits"):
        table.add_column(column, justify="left" if column in ("device", "plan") else "right")
    for r in rows:
        table.add_row(r.device, f"{r.budget_bytes / MIB:.1f}", r.label, f"{r.params:,}", f"{r.training_macs / 1e9:.2f}",
                      f"{r.memory_bytes / MIB:.1f}", "–" if r.step_ms is None else f"{r.step_ms:.1f}",
                      "[green]yes[/green]" if r.fits else "[red]no[/red]")
    return table


def plan_main(argv: list[str]) -> int:
    """`nestling plan PROFILE... [--budget-mb ...] --method M --model M --out plan.json`."""
    from profiler.plan_methods import plan_rows

    args = _plan_parser().parse_args(argv)
    console = _console()
    try:
        devices, profile_batch = _devices(args)
        batch = args.batch or profile_batch or 32
        rows, extra = plan_rows(args.method, args.model, devices, batch=batch,
                                shape=(args.in_channels, args.image_size, args.image_size), classes=args.classes,
                                levels=args.levels, tolerance=args.tolerance, options=_parse_options(args.option))
    except (NestlingError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    _write_json(args.out, plan_to_json(args.method, rows, batch, model=args.model, **extra))
    console.print(_plan_table(args.method, rows))
    console.print(f"plan written to {args.out}")
    return 0


if __name__ == "__main__":  # pragma: no cover - `python -m profiler.cli profile|plan ...`
    command, rest = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("", [])
    sys.exit(profile_main(rest) if command == "profile" else plan_main(rest) if command == "plan" else 2)
