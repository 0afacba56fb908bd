"""A model family defined only here, registered by decorator, goes through every public code path:
build and slicing, the profiler's estimator (no walk: costs come from running it), a simulated FedAvg and HeteroFL round, and ONNX export
with parity. If this needs an edit outside this file, adding a family is no longer one module."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nestling.config import config_from_dict
from nestling.errors import SpecError
from nestling.models import ModelConfig, build, known_models
from nestling.models.context import BuildContext
from nestling.models.cost import count_macs, count_parameters
from nestling.models.family import ModelFamily, register_family, unregister_family
from nestling.models.net import BlockInfo
from nestling.spec import SubmodelSpec

DIM = 24
NAME = "toy-mlp"


class FlattenStem(nn.Module):
    def __init__(self, ctx: BuildContext) -> None:
        super().__init__()
        pixels = ctx.model.in_channels * ctx.model.image_size**2
        self.fc = ctx.linear(pixels, DIM, slim_out=True, in_ratio=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.fc(x.flatten(1)))


class DenseBlock(nn.Module):
    def __init__(self, ctx: BuildContext, *, skipped: bool) -> None:
        super().__init__()
        self.skipped = skipped
        if not skipped:
            self.fc = ctx.linear(DIM, DIM, slim_out=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.skipped else x + F.relu(self.fc(x))


class LinearHead(nn.Module):
    def __init__(self, ctx: BuildContext) -> None:
        super().__init__()
        self.fc = ctx.classifier(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class ToyMlp(ModelFamily):
    """Three residual dense blocks over the flattened image."""

    name = NAME
    groupable = True  # per-client slices stay apart: the flatten is client-major, the rest is linear

    def block_infos(self, image_size: int, extra: dict[str, Any]) -> tuple[BlockInfo, ...]:
        return tuple(BlockInfo(i, 0, DIM, DIM, 1, 1, 1) for i in range(3))

    def build_parts(self, spec, ctx, infos, kept, depth):  # type: ignore[no-untyped-def]
        if spec.exits:
            raise SpecError(f"{NAME} has no exits")
        blocks: list[nn.Module] = [DenseBlock(ctx, skipped=i not in kept) for i in range(depth)]
        return FlattenStem(ctx), blocks, {}, LinearHead(ctx) if spec.head else None


@pytest.fixture(scope="module", autouse=True)
def toy_family() -> Iterator[None]:
    register_family(ToyMlp)
    yield
    unregister_family(NAME)


def test_the_registered_family_builds_slices_and_lists_its_blocks() -> None:
    assert NAME in known_models()
    spec = SubmodelSpec(ModelConfig(NAME, in_channels=1, image_size=8), width=0.5, blocks=(0, 2))
    net = build(spec)
    assert net.blocks[1].skipped and net.stem.fc.weight.shape == (12, 64)
    assert net(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    with pytest.raises(SpecError, match="keeps no residual block"):
        build(SubmodelSpec(ModelConfig(NAME), blocks=()))


def test_the_estimator_derives_its_costs_from_the_real_module() -> None:
    from nestling.profiler.estimator import estimate
    from nestling.profiler.measure import profile_model

    spec = SubmodelSpec(ModelConfig(NAME, in_channels=1, image_size=8), width=0.5, blocks=(0, 2))
    cost = estimate(spec, 4)
    assert cost.params == count_parameters(build(spec))
    assert cost.forward_macs == count_macs(build(spec), (1, 8, 8))
    measured = profile_model(spec, 4, repeats=1, warmup=0, rss_check=False)
    assert cost.activation_bytes == measured["total"]["activations_bytes"]
    assert [p.name for p in cost.parts] == ["stem", "block0", "block1", "block2", "head"]


def test_same_spec_clients_train_grouped_exactly_as_one_by_one() -> None:
    from nestling.edge.procedures import ClientData, DeviceStore
    from nestling.edge.trainer import run_task
    from nestling.messages import Task
    from nestling.simulator.batched import train_batched
    from nestling.simulator.grouped import groupable

    spec = SubmodelSpec(ModelConfig(NAME, num_classes=5, in_channels=2, image_size=4), width=0.5)
    assert groupable(build(spec))
    torch.manual_seed(1)
    weights = build(spec).state_dict()
    hp = {"lr": 0.05, "batch_size": 8, "local_epochs": 1, "momentum": 0.9}
    tasks = [
        Task(
            1,
            f"dev-{k}",
            spec.to_dict(),
            {n: v.clone() for n, v in weights.items()},
            "sgd",
            {**hp, "seed": 50 + k},
            task_id=f"r1-dev-{k}",
        )
        for k in range(3)
    ]
    datas = []
    for k in range(3):
        generator = torch.Generator().manual_seed(k)
        datas.append(
            ClientData(
                torch.randn(16, 2, 4, 4, generator=generator),
                torch.randint(0, 5, (16,), generator=generator),
                "none",
            )
        )
    alone = [run_task(t, d, DeviceStore()) for t, d in zip(tasks, datas)]
    together = train_batched(tasks, datas, how="grouped")
    for one, many in zip(alone, together):
        for key, value in one.weights.items():
            torch.testing.assert_close(many.weights[key], value, rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("method", ["fedavg", "heterofl"])
def test_it_trains_a_simulated_round_and_exports_to_onnx_with_parity(method: str, tmp_path: Path) -> None:
    from nestling.export.options import ExportOptions
    from nestling.export.pipeline import export_submodel
    from nestling.simulator.run import run_simulation

    cfg = config_from_dict(
        {
            "run": {"rounds": 1, "workers": 1, "eval_every": 1},
            "data": {"dataset": "digits", "clients": 4},
            "model": {"arch": NAME},
            "method": {"name": method},
            "train": {"fraction": 1.0, "local_steps": 2, "batch_size": 16, "lr": 0.05},
        }
    )
    summary = run_simulation(cfg, tmp_path / "run")
    assert 0.0 <= summary["worst_accuracy"] <= 1.0
    checkpoint = sorted((tmp_path / "run" / "checkpoints").glob("round-*"))[-1]
    report = export_submodel(
        checkpoint,
        tmp_path / "bundle",
        level=1,
        data="digits",
        options=ExportOptions(benchmark=False, calib_samples=64, eval_samples=64),
    )
    assert (tmp_path / "bundle").is_dir()
    text = json.dumps(report, default=str)
    assert "parity" in text, text[:500]
    print(text[:2000])
