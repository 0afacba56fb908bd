"""Estimator against measurement, and the FeDepth memory claim measured on this machine.

1. Saved-activation bytes of every part (stem, blocks, head) of ResNet-20, PreResNet-20 and ResNet-18 at batch
   32: analytic estimate (profiler/estimator.py) against autograd's saved tensors (profiler/measure.py).
2. A client whose budget is the training memory of the 1/6-width PreResNet-20 (measured) trains the full-width
   model with FeDepth; every stage's peak is measured while it trains (saved activations + weights, gradients
   and momentum it holds). The same for the `lack` budget (1/8 width, partial training).
Ends with one line: max_activation_error=… fedepth_peak_over_budget=…
Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/profiler.py
"""

from __future__ import annotations

import argparse

import torch

from nestling.edge.procedures import ClientData
from nestling.edge.procedures.depthwise import measure_stage_peaks
from nestling.models import ModelConfig, build
from nestling.profiler.decompose import StagePlan
from nestling.profiler.estimator import estimate
from nestling.profiler.measure import profile_model
from nestling.server.strategies import DeviceInfo, StrategyContext, create_strategy
from nestling.spec import SubmodelSpec
from nestling.task_params import FedepthParams

BATCH = 32
MIB = 2**20


def activation_errors() -> float:
    worst = 0.0
    for model in (
        ModelConfig("resnet20"),
        ModelConfig("preresnet20", norm_stats="batch"),
        ModelConfig("resnet18"),
    ):
        spec = SubmodelSpec(model)
        measured = {
            p["name"]: p["memory"]["activations_bytes"]
            for p in profile_model(spec, BATCH, repeats=1, warmup=0, rss_check=False)["parts"]
        }
        errors = {
            p.name: abs(p.activation_bytes - measured[p.name]) / measured[p.name]
            for p in estimate(spec, BATCH).parts
        }
        name = max(errors, key=errors.__getitem__)
        print(
            f"{model.arch:12s} parts {len(errors):2d}  measured {sum(measured.values()) / MIB:7.2f} MiB  "
            f"largest relative error {errors[name]:.2e} ({name})"
        )
        worst = max(worst, max(errors.values()))
    return worst


def fedepth_peaks(budgets: str) -> float:
    ctx = StrategyContext(
        arch="preresnet20",
        num_classes=10,
        in_channels=3,
        image_size=32,
        num_clients=4,
        total_rounds=1,
        local={"batch_size": BATCH, "momentum": 0.9, "local_steps": 3},
        options={"budgets": budgets},
    )
    strategy = create_strategy("fedepth", ctx)
    task = strategy.assign(0, [DeviceInfo("weakest", 0, 128)])["weakest"]
    plan = StagePlan.from_dict(task.hparams["plan"])
    ratio = strategy.ratios[0]
    budget = profile_model(
        SubmodelSpec(strategy.model, width=ratio), BATCH, repeats=1, warmup=1, momentum=0.9, rss_check=False
    )["total"]["peak_training_bytes"]
    net = build(SubmodelSpec.from_dict(task.spec), init=False)
    net.load_state_dict(task.weights)
    generator = torch.Generator().manual_seed(0)
    data = ClientData(
        torch.randn(128, 3, 32, 32, generator=generator), torch.randint(0, 10, (128,), generator=generator)
    )
    peaks = measure_stage_peaks(
        [net], plan, data, FedepthParams.from_hparams({**task.hparams, "lr": 0.01}), generator
    )
    print(
        f"{budgets:5s} r=1/{round(1 / ratio)}  budget {budget / MIB:6.2f} MiB (planned {strategy.ratio_bytes[ratio] / MIB:.2f})"
        f"  stages {plan.describe()}"
    )
    print("      stage peak / budget: " + " ".join(f"{p / budget:.3f}" for p in peaks))
    return max(peaks) / budget


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    torch.set_num_threads(1)
    error = activation_errors()
    fair = fedepth_peaks("fair")
    lack = fedepth_peaks("lack")
    print(f"lack_peak_over_budget={lack:.4f}")
    print(f"max_activation_error={error:.4f} fedepth_peak_over_budget={fair:.4f}")


if __name__ == "__main__":
    main()
