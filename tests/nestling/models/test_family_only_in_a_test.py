"""A MobileNetV2-style family that exists only in this test — no walk, no export code — goes through NeFL-WD,
the profiler and ONNX export.

Its blocks are inverted residuals (1×1 expand → ReLU6 → depthwise 3×3 → ReLU6 → 1×1 project, step size on the
branch) whose stage-opening block has a 1×1 conv + BN projection shortcut. The round runs through the real
simulator and Coordinator on digits; the profiler's estimate must equal a measured training step's saved bytes
(ReLU6 keeps its input, which no hand-written walk had an op for); the planner picks a member for a budget; the
export, with the projection block skipped, must match PyTorch in ONNX Runtime. The registry is restored after.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nestling.config import config_from_dict
from nestling.models import ModelConfig, build, known_models
from nestling.models.context import BuildContext
from nestling.models.family import ModelFamily, register_family, registered_families, unregister_family
from nestling.models.net import BlockInfo
from nestling.spec import SubmodelSpec

NAME = f"mobilenet-test-{uuid.uuid4().hex[:8]}"  # never collides with a shipped or another test's family
STEM = 8
STAGES = ((8, 1, 1), (16, 2, 2))  # (width, blocks, stride of the first block)
EXPAND = 2


def _conv_bn(
    ctx: BuildContext, cin: int, cout: int, kernel: int, stride: int = 1, **kw: Any
) -> list[nn.Module]:
    return [ctx.conv(cin, cout, kernel, stride=stride, **kw), ctx.scaler(), ctx.norm(cout)]


class Stem(nn.Module):
    def __init__(self, ctx: BuildContext) -> None:
        super().__init__()
        self.body = nn.Sequential(
            *_conv_bn(ctx, ctx.model.in_channels, STEM, 3, image_input=True), nn.ReLU6()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class InvertedResidual(nn.Module):
    def __init__(self, ctx: BuildContext, info: BlockInfo, *, skipped: bool) -> None:
        super().__init__()
        self.skipped = skipped
        self.has_projection = info.stride != 1 or info.global_in != info.global_out
        if self.has_projection:
            self.shortcut = nn.Sequential(*_conv_bn(ctx, info.global_in, info.global_out, 1, info.stride))
        if skipped:
            return
        hidden = info.global_in * EXPAND
        self.branch = nn.Sequential(
            *_conv_bn(ctx, info.global_in, hidden, 1),
            nn.ReLU6(),
            *_conv_bn(ctx, hidden, hidden, 3, info.stride, depthwise=True),
            nn.ReLU6(),
            *_conv_bn(ctx, hidden, info.global_out, 1),
        )
        self.step = nn.Parameter(torch.ones(1), requires_grad=ctx.model.learnable_step)  # NeFL's s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.shortcut(x) if self.has_projection else x
        return skip if self.skipped else skip + self.step * self.branch(x)


class Head(nn.Module):
    def __init__(self, ctx: BuildContext) -> None:
        super().__init__()
        self.fc = ctx.classifier(STAGES[-1][0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean((2, 3)))


class MobileNetTest(ModelFamily):
    name = NAME

    def block_infos(self, image_size: int, extra: dict[str, Any]) -> tuple[BlockInfo, ...]:
        infos: list[BlockInfo] = []
        channels, size = STEM, image_size
        for stage, (width, count, first_stride) in enumerate(STAGES):
            for j in range(count):
                stride = first_stride if j == 0 else 1
                out = (size + stride - 1) // stride
                infos.append(BlockInfo(len(infos), stage, channels, width, stride, size, out))
                channels, size = width, out
        return tuple(infos)

    def build_parts(self, spec, ctx, infos, kept, depth):
        blocks: list[nn.Module] = [
            InvertedResidual(ctx, i, skipped=i.index not in kept) for i in infos[:depth]
        ]
        return Stem(ctx), blocks, {}, Head(ctx) if spec.head else None


@pytest.fixture(scope="module", autouse=True)
def family() -> Iterator[None]:
    before = dict(registered_families())
    register_family(MobileNetTest)
    yield
    unregister_family(NAME)
    assert registered_families() == before


def _model() -> ModelConfig:
    return ModelConfig(NAME, in_channels=1, image_size=8, num_classes=10)


def test_the_profiler_derives_its_costs_and_plans_with_them() -> None:
    from nestling.models.cost import count_macs, count_parameters
    from nestling.profiler.estimator import estimate
    from nestling.profiler.measure import profile_model
    from nestling.profiler.planner import largest_fitting

    assert NAME in known_models()
    spec = SubmodelSpec(_model(), width=0.5, blocks=(0, 2))  # block 1, the projection block, skipped
    net = build(spec)
    cost = estimate(spec, 4)
    assert cost.params == count_parameters(net)
    assert cost.forward_macs == count_macs(net, (1, 8, 8))
    measured = profile_model(spec, 4, repeats=1, warmup=0, rss_check=False)
    by_part = {p["name"]: p["memory"]["activations_bytes"] for p in measured["parts"]}
    assert {p.name: p.activation_bytes for p in cost.parts} == by_part
    assert cost.activation_bytes == measured["total"]["activations_bytes"]
    members = [SubmodelSpec(_model(), width=w) for w in (0.25, 0.5, 1.0)]
    budget = estimate(members[1], 16).training_bytes
    assert largest_fitting(members, budget, 16) == 1
    assert largest_fitting(members, budget - 1, 16) == 0


def test_a_nefl_wd_round_and_an_onnx_export_with_the_projection_block_skipped(tmp_path: Path) -> None:
    from nestling.export.options import ExportOptions
    from nestling.export.pipeline import export_submodel
    from nestling.simulator.run import run_simulation

    cfg = config_from_dict(
        {
            "run": {"rounds": 1, "workers": 1, "eval_every": 1},
            "data": {"dataset": "digits", "clients": 5},
            "model": {"arch": NAME},
            "method": {"name": "nefl-wd"},
            "train": {"fraction": 1.0, "local_steps": 2, "batch_size": 16, "lr": 0.05},
        }
    )
    summary = run_simulation(cfg, tmp_path / "run")
    assert 0.0 <= summary["worst_accuracy"] <= 1.0
    checkpoint = sorted((tmp_path / "run" / "checkpoints").glob("round-*"))[-1]
    digits = ModelConfig(
        NAME, in_channels=1, image_size=16, num_classes=10
    )  # the run's model (digits: 1×16×16)
    spec = SubmodelSpec(digits, width=0.5, blocks=(0, 2))  # block 1 (stride 2, 8 → 16 channels) skipped
    assert build(spec).blocks[1].has_projection
    options = ExportOptions(benchmark=False, calib_samples=32, eval_samples=32)
    report = export_submodel(checkpoint, tmp_path / "bundle", spec=spec, data="digits", options=options)
    onnx = report["parity"]["onnx_fp32"]
    assert onnx and max(r["max_rel"] for r in onnx.values()) <= options.parity_tolerance
    assert any((tmp_path / "bundle").glob("*.onnx"))
