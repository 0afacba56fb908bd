"""`nestling export`: the command-line front of `export_submodel` (entry: `export_main`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from nestling.cli_numbers import positive_int
from nestling.errors import NestlingError

NO_DATA = "none"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nestling export", description="Export a trained submodel as a verified ONNX / TensorRT bundle."
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        help="round-XXXXXX folder, or a run / checkpoints folder (newest complete round)",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--submodel", help="submodel name (k1, L2, r0.5, p0.4, d1, ...) or spec id")
    which.add_argument(
        "--level", type=positive_int, help="1-based submodel position, smallest first (ScaleFL level)"
    )
    which.add_argument(
        "--spec", type=Path, help="SubmodelSpec JSON file, sliced from the deployable full model"
    )
    parser.add_argument(
        "--list", action="store_true", help="list the checkpoint's submodels and their exits, then stop"
    )
    parser.add_argument(
        "--format",
        choices=("onnx", "tensorrt"),
        default="onnx",
        help="onnx (default; runs anywhere onnxruntime does) or tensorrt (a Jetson engine)",
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "fp16", "int8"),
        default="fp16",
        help="TensorRT engine precision (int8 uses the calibration images)",
    )
    outputs = parser.add_mutually_exclusive_group()
    outputs.add_argument("--exit", help="keep only this output: the block index an exit follows, or 'head'")
    outputs.add_argument(
        "--all-exits", action="store_true", help="every exit as an extra output (adaptive inference)"
    )
    parser.add_argument(
        "--quantize", choices=("int8",), help="add a static int8 (QDQ) model calibrated on real data"
    )
    parser.add_argument(
        "--calib-data",
        metavar="DATASET",
        help="dataset for calibration, accuracy and real-input parity (default: the checkpoint's; "
        f"'{NO_DATA}' for random-input parity only)",
    )
    parser.add_argument("--data-root", help="folder of file-backed datasets (or NESTLING_DATA_ROOT)")
    parser.add_argument(
        "--calib-samples", type=positive_int, default=1024, help="training images for calibration"
    )
    parser.add_argument(
        "--eval-samples", type=positive_int, default=2000, help="held-out test images for accuracy"
    )
    parser.add_argument("--opset", type=positive_int, default=None, help="ONNX opset (default 17)")
    simplify = parser.add_mutually_exclusive_group()
    simplify.add_argument(
        "--simplify",
        dest="simplify",
        action="store_const",
        const=True,
        help="simplify with onnxsim (pip install nestling[simplify])",
    )
    simplify.add_argument(
        "--no-simplify", dest="simplify", action="store_const", const=False, help="keep the graph as exported"
    )
    parser.add_argument("--dynamo", action="store_true", help="use the torch.export-based ONNX exporter")
    parser.add_argument(
        "--align-channels",
        type=positive_int,
        default=8,
        help="zero-pad conv feature maps to this multiple for fast CPU kernels (1: off; outputs unchanged)",
    )
    parser.add_argument("--no-benchmark", action="store_true", help="skip the latency measurement")
    parser.add_argument(
        "--threads", type=positive_int, default=1, help="threads for PyTorch and ONNX Runtime alike"
    )
    parser.add_argument("--out", type=Path, help="bundle folder to write")
    return parser


def _summary(manifest: dict[str, Any], out: Path) -> str:
    lines = [
        f"bundle {out}: {manifest['source']['submodel']} ({manifest['spec_id']}), output {manifest['exit']}"
    ]
    for name, checks in manifest["parity"].items():
        cells = ", ".join(
            f"{kind} max_abs={r['max_abs']:.2e} rel={r['max_rel']:.2e} top1={r['top1_agreement']:.3f}"
            for kind, r in checks.items()
        )
        lines.append(f"parity {name}: {cells}")
    for key, row in (manifest.get("latency_ms") or {}).items():
        if key.startswith("batch_"):
            cells = ", ".join(
                f"{name} p50={row[name]['p50_ms']:.3f} p90={row[name]['p90_ms']:.3f}"
                for name in row
                if name != "speedup_p50"
            )
            ratios = ", ".join(f"{name} ×{v:.2f}" for name, v in row["speedup_p50"].items())
            lines.append(f"latency {key} (ms): {cells}; vs pytorch_eager: {ratios}")
    if manifest.get("accuracy"):
        acc = manifest["accuracy"]
        cells = ", ".join(f"{k}={v:.4f}" for k, v in acc.items() if isinstance(v, float))
        lines.append(f"accuracy on {acc['samples']} {acc['dataset']} test images: {cells}")
    return "\n".join(lines)


def export_main(argv: list[str]) -> int:
    """CLI entry of `nestling export`; returns the process exit code."""
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except NestlingError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2  # as every nestling command: 2 is a refused input, never a crash


def _run(args: argparse.Namespace) -> int:
    # Heavy imports only once the arguments are known to be well-formed.
    from nestling.errors import ConfigError
    from nestling.export.pipeline import ExportOptions, export_target, load_export_data
    from nestling.export.source import load_spec_file, open_checkpoint, select_target
    from nestling.export.tensorrt_build import TensorRTConfig, require_tensorrt

    if args.format == "tensorrt" and not args.list:
        require_tensorrt()  # the one clear line before any other work
    source = open_checkpoint(args.checkpoint)
    if args.list:
        for target in source.targets():
            exits = ", ".join(str(e) for e in target.spec.exits)
            print(
                f"{target.name}\t{target.spec.id}\twidth={target.spec.width:g}\texits after blocks: "
                f"{exits or '-'}{'; head' if target.spec.head else ''}"
            )
        return 0
    if args.out is None:
        raise ConfigError("--out BUNDLE is required")
    options = ExportOptions(
        format=args.format,
        exit=args.exit,
        all_exits=args.all_exits,
        quantize=args.quantize,
        simplify=args.simplify,
        dynamo=args.dynamo,
        align_channels=args.align_channels,
        calib_samples=args.calib_samples,
        eval_samples=args.eval_samples,
        benchmark=not args.no_benchmark,
        threads=args.threads,
        tensorrt=TensorRTConfig(precision=args.precision),
    )
    if args.opset is not None:
        options.opset = args.opset
    spec = load_spec_file(args.spec) if args.spec is not None else None
    target = select_target(source, submodel=args.submodel, level=args.level, spec=spec)
    dataset = args.calib_data or source.dataset
    data = None
    if dataset and dataset != NO_DATA:
        data = load_export_data(
            dataset,
            args.data_root,
            calib_samples=args.calib_samples,
            eval_samples=args.eval_samples,
            seed=options.seed,
        )
    info = {"checkpoint": str(source.path), "method": source.method, "round": source.round}
    manifest = export_target(target, args.out, data=data, options=options, source=info)
    print(_summary(manifest, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(export_main(sys.argv[1:]))
