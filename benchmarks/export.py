"""Export benchmark: ONNX Runtime vs PyTorch eager, smallest vs full NeFL-WD submodel, int8 accuracy/speed.

One run on this CPU, everything timed side by side (interleaved, same thread count):
1. trains NeFL-WD ResNet-20 briefly on CIFAR-10 through the real simulator (or reuses the
   run folder's checkpoint when its config matches), so accuracy and the int8 drop mean something;
2. exports the smallest (k1) and the full (k5) submodel with int8, calibrated on training images and
   scored on the whole CIFAR-10 test split;
3. times PyTorch eager, ONNX Runtime fp32 and int8 for both at batch 1 and 32;
4. ends with `ort_speedup_b1=… smallest_over_full=… int8_acc_drop=…`.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/export.py --data-root ../shared/data
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nestling.config import config_from_dict
from nestling.export.ort_bench import latency_table, ort_runner, ort_session
from nestling.export.parity import Runner
from nestling.export.pipeline import ExportData, ExportOptions, export_target, load_export_data
from nestling.export.reference import reference_model
from nestling.export.source import open_checkpoint
from nestling.export.standalone import plan_outputs, reference_outputs
from nestling.server.checkpoint import latest_checkpoint
from nestling.simulator.run import run_simulation
from nestling.strict_json import strict_dumps


def training_config(args: argparse.Namespace) -> dict[str, Any]:
    """NeFL-WD ResNet-20 on IID CIFAR-10 (or a subset), every client every round, SGD with momentum."""
    return {
        "run": {"rounds": args.rounds, "workers": 1, "eval_every": args.rounds, "seed": 0},
        "data": {
            "dataset": "cifar10",
            "root": args.data_root,
            "clients": args.clients,
            "partition": "iid",
            "limit_train": args.limit_train,
        },
        "model": {"arch": "resnet20"},
        "method": {"name": "nefl-wd"},
        "train": {
            "fraction": 1.0,
            "local_epochs": 1,
            "batch_size": 32,
            "lr": 0.05,
            "momentum": 0.9,
            "weight_decay": 5e-4,
            "schedule": "step",
            "milestones": [0.67, 0.85],
        },
    }


def trained_checkpoint(args: argparse.Namespace) -> Path:
    """The run folder's newest checkpoint when it was trained with this config, else a fresh training run."""
    config = training_config(args)
    stamp = args.run_dir / "benchmark-config.json"
    found = latest_checkpoint(args.run_dir / "checkpoints") if args.run_dir.exists() else None
    if found is not None and not args.retrain and stamp.is_file() and json.loads(stamp.read_text()) == config:
        print(f"reusing {found} (trained with the same config; --retrain to train again)")
        return found
    # A previous run's later rounds would outrank (and the checkpoint rotation delete) this run's.
    shutil.rmtree(args.run_dir / "checkpoints", ignore_errors=True)
    stamp.unlink(missing_ok=True)
    started = time.perf_counter()
    summary = run_simulation(config_from_dict(config), args.run_dir, overwrite=True)
    stamp.write_text(strict_dumps(config, indent=1, sort_keys=True))
    print(
        f"trained {args.rounds} rounds in {time.perf_counter() - started:.0f} s; final accuracy "
        f"worst {summary['worst_accuracy']:.4f}, mean {summary['avg_accuracy']:.4f} over the five submodels"
    )
    found = latest_checkpoint(args.run_dir / "checkpoints")
    assert found is not None
    return found


def eager_runner(target: Any, data: ExportData) -> Runner:
    net = reference_model(target, data.calibration)
    plan = plan_outputs(net, ensemble=target.ensemble)

    def run(x: np.ndarray) -> list[np.ndarray]:
        with torch.inference_mode():
            return [t.numpy() for t in reference_outputs(net, plan, torch.from_numpy(x))]

    return run


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data-root",
        default=os.environ.get(
            "NESTLING_DATA_ROOT", str(Path(__file__).resolve().parents[2] / "shared" / "data")
        ),
        help="folder with cifar10/ (default: $NESTLING_DATA_ROOT, else ../shared/data beside the repo)",
    )
    parser.add_argument("--run-dir", type=Path, default=Path("runs/bench-export"))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--limit-train", type=int, default=None, help="training images (default: all 50,000)")
    parser.add_argument("--calib-samples", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bench-rounds", type=int, default=10)
    parser.add_argument("--bench-per-round", type=int, default=40)
    parser.add_argument("--retrain", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    checkpoint = trained_checkpoint(args)
    source = open_checkpoint(checkpoint)
    data = load_export_data("cifar10", args.data_root, calib_samples=args.calib_samples, eval_samples=None)
    targets = source.targets()
    small, full = targets[0], targets[-1]
    options = ExportOptions(quantize="int8", benchmark=False, threads=args.threads)
    info = {"checkpoint": str(source.path), "method": source.method, "round": source.round}
    manifests = {}
    runners: dict[str, Runner] = {}
    for target in (full, small):
        out = args.run_dir / "bundles" / target.name
        manifests[target.name] = export_target(target, out, data=data, options=options, source=info)
        runners[f"pytorch_eager[{target.name}]"] = eager_runner(target, data)
        runners[f"onnxruntime[{target.name}]"] = ort_runner(ort_session(out / "model.onnx", args.threads))
        runners[f"onnxruntime_int8[{target.name}]"] = ort_runner(
            ort_session(out / "model.int8.onnx", args.threads)
        )
    shape = tuple(data.heldout_x.shape[1:])
    table = latency_table(
        runners,
        shape,
        batches=(1, 32),
        threads=args.threads,
        rounds=args.bench_rounds,
        per_round=args.bench_per_round,
    )

    def p50(batch: int, name: str) -> float:
        return float(table[f"batch_{batch}"][name]["p50_ms"])

    print(
        f"\nsubmodels: {small.name} (width {small.spec.width:.3f}, blocks {small.spec.blocks}) and "
        f"{full.name} (full); {args.threads} thread(s) for PyTorch and ONNX Runtime alike"
    )
    for name, manifest in manifests.items():
        acc, parity = manifest["accuracy"], manifest["parity"]["onnx_fp32"]["real"]
        print(
            f"{name}: accuracy on {acc['samples']} CIFAR-10 test images: pytorch {acc['pytorch']:.4f}, "
            f"onnx fp32 {acc['onnx_fp32']:.4f}, onnx int8 {acc['onnx_int8']:.4f} "
            f"(drop {acc['int8_drop_points']:.2f} points); parity max_abs {parity['max_abs']:.2e}"
        )
    print(f"\n{'latency p50 / p90 (ms)':34s}{'batch 1':>20s}{'batch 32':>20s}")
    for name in runners:
        cells = "".join(
            f"{p50(b, name):>11.3f} / {table[f'batch_{b}'][name]['p90_ms']:<6.3f}" for b in (1, 32)
        )
        print(f"{name:34s}{cells}")
    results = {
        "ort_speedup_b1": p50(1, f"pytorch_eager[{full.name}]") / p50(1, f"onnxruntime[{full.name}]"),
        "ort_speedup_b1_smallest": p50(1, f"pytorch_eager[{small.name}]")
        / p50(1, f"onnxruntime[{small.name}]"),
        "ort_speedup_b32": p50(32, f"pytorch_eager[{full.name}]") / p50(32, f"onnxruntime[{full.name}]"),
        "smallest_over_full": p50(1, f"onnxruntime[{small.name}]") / p50(1, f"onnxruntime[{full.name}]"),
        "smallest_over_full_b32": p50(32, f"onnxruntime[{small.name}]")
        / p50(32, f"onnxruntime[{full.name}]"),
        "int8_acc_drop": manifests[full.name]["accuracy"]["int8_drop_points"],
        "int8_acc_drop_smallest": manifests[small.name]["accuracy"]["int8_drop_points"],
        "int8_speedup_b1": p50(1, f"onnxruntime[{full.name}]") / p50(1, f"onnxruntime_int8[{full.name}]"),
        "int8_speedup_b32": p50(32, f"onnxruntime[{full.name}]") / p50(32, f"onnxruntime_int8[{full.name}]"),
    }
    print(
        "\n"
        + "  ".join(
            f"{k}={v:.3f}"
            for k, v in results.items()
            if k not in ("ort_speedup_b1", "smallest_over_full", "int8_acc_drop")
        )
    )
    (args.run_dir / "benchmark-results.json").write_text(
        json.dumps(
            {
                "results": results,
                "latency_ms": table,
                "accuracy": {n: m["accuracy"] for n, m in manifests.items()},
            },
            indent=1,
        )
    )
    print(
        f"ort_speedup_b1={results['ort_speedup_b1']:.2f} "
        f"smallest_over_full={results['smallest_over_full']:.2f} "
        f"int8_acc_drop={results['int8_acc_drop']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
