"""`nestling profile`: measure training cost per block on this board and write a device profile."""

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

from nestling.cli_numbers import non_negative_int, positive_float, positive_int, share
from nestling.errors import NestlingError
from nestling.models.config import ModelConfig
from nestling.models.zoo import known_models
from nestling.profiler.device import device_info
from nestling.profiler.measure import profile_model
from nestling.spec import SubmodelSpec
from nestling.strict_json import strict_dumps

MIB = 2**20


def _console() -> Console:
    """Wide tables even when piped (rich would fold them to 80 columns)."""
    return Console() if sys.stdout.isatty() else Console(width=160)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(strict_dumps(data, indent=2) + "\n")
    tmp.replace(path)


def _profile_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nestling profile", description="Measure training cost per block on this machine."
    )
    p.add_argument("--model", choices=known_models(), help="architecture (or give --spec)")
    p.add_argument("--spec", type=Path, help="JSON SubmodelSpec to profile instead of --model/--width")
    p.add_argument("--width", type=share, default=1.0, help="channel ratio of the profiled submodel")
    p.add_argument("--batch", type=positive_int, default=32, help="training batch measured (default 32)")
    p.add_argument(
        "--classes", type=positive_int, default=10, help="classes of the model's head (default 10)"
    )
    p.add_argument("--image-size", type=positive_int, default=32, help="input side in pixels (default 32)")
    p.add_argument("--in-channels", type=positive_int, default=3, help="input channels (default 3)")
    p.add_argument(
        "--norm-stats",
        default="running",
        choices=("running", "batch"),
        help="batch norm in the profiled forward: running statistics (default) or batch statistics",
    )
    p.add_argument("--repeats", type=positive_int, default=10, help="timed passes per block (default 10)")
    p.add_argument("--warmup", type=non_negative_int, default=3, help="untimed passes first (default 3)")
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to measure: cpu or cuda[:i] (default: cuda when there is one)",
    )
    p.add_argument("--name", help="device name recorded in the profile (default: host name)")
    p.add_argument(
        "--budget-mb",
        type=positive_float,
        help="memory this device may spend on training, recorded for planning",
    )
    p.add_argument(
        "--gflops-seconds", type=positive_float, default=1.0, help="duration of the sustained matmul test"
    )
    p.add_argument(
        "--out", type=Path, default=Path("profile.json"), help="profile to write (default profile.json)"
    )
    return p


def _spec_from_args(args: argparse.Namespace) -> SubmodelSpec:
    if args.spec is not None:
        if not args.spec.is_file():
            raise NestlingError(f"spec file {args.spec} does not exist")
        return SubmodelSpec.from_dict(json.loads(args.spec.read_text()))
    if args.model is None:
        raise NestlingError("give --model or --spec")
    model = ModelConfig(
        args.model,
        num_classes=args.classes,
        in_channels=args.in_channels,
        image_size=args.image_size,
        norm_stats=args.norm_stats,
    )
    return SubmodelSpec(model, width=args.width)


def _profile_table(profile: dict[str, Any]) -> Table:
    table = Table(
        title=f"{profile['model']['arch']} · batch {profile['model']['batch']} · {profile['model']['device']}"
    )
    for column in (
        "part",
        "params",
        "fwd ms (p50/p90)",
        "bwd ms (p50/p90)",
        "activations MiB",
        "training MiB",
    ):
        table.add_column(column, justify="left" if column == "part" else "right")
    for part in profile["parts"]:
        f, b, m = part["forward_ms"], part["backward_ms"], part["memory"]
        table.add_row(
            part["name"],
            f"{part['params']:,}",
            f"{f['median']:.2f}/{f['p90']:.2f}",
            f"{b['median']:.2f}/{b['p90']:.2f}",
            f"{m['activations_bytes'] / MIB:.2f}",
            f"{m['training_bytes'] / MIB:.2f}",
        )
    total = profile["total"]
    table.add_row(
        "[b]whole step",
        "",
        f"{total['step_ms']['median']:.1f}/{total['step_ms']['p90']:.1f}",
        "",
        f"{total['activations_bytes'] / MIB:.2f}",
        f"{total['peak_training_bytes'] / MIB:.2f}",
    )
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
    profile = {
        "schema": measured.pop("schema"),
        "created": dt.datetime.now(dt.timezone.utc).isoformat(),
        "name": args.name or device["hostname"],
        "device": device,
        **measured,
        "budget": {"memory_bytes": int(args.budget_mb * MIB)} if args.budget_mb else None,
    }
    _write_json(args.out, profile)
    console.print(_profile_table(profile))
    rss = profile["total"]["rss"]
    if rss:
        console.print(
            f"RSS growth over a forward pass: {rss['forward_delta_bytes'] / MIB:.1f} MiB "
            f"({rss['ratio_to_activations']:.2f}× the metered activations)"
        )
    console.print(f"sustained {device['compute']['gflops']:.1f} GFLOP/s · profile written to {args.out}")
    return 0


if __name__ == "__main__":  # pragma: no cover - `python -m nestling.profiler.cli ...`
    sys.exit(profile_main(sys.argv[1:]))
