"""Precision and memory format are task hyper-parameters that every backend honours (edge.execution)."""

from __future__ import annotations

import pytest
import torch

from nestling.config import load_config
from nestling.edge.execution import apply_memory_format, task_precision
from nestling.errors import ConfigError
from nestling.models.config import ModelConfig
from nestling.models.zoo import build
from nestling.spec import SubmodelSpec
from nestling.task_params import TrainParams


def test_bf16_runs_convolutions_in_bfloat16_and_fp32_does_not() -> None:
    conv = torch.nn.Conv2d(3, 4, 3)
    x = torch.randn(2, 3, 8, 8)
    with task_precision(TrainParams(precision="bf16"), "cpu"):
        assert conv(x).dtype == torch.bfloat16
    with task_precision(TrainParams(), "cpu"):
        assert conv(x).dtype == torch.float32


def test_a_forward_under_bf16_sees_the_weights_as_they_are_now_not_as_first_cast() -> None:
    # The context spans a whole local procedure: a cached bf16 copy of each weight would make every
    # forward after the first optimiser step run on the downloaded weights.
    conv = torch.nn.Conv2d(3, 4, 3)
    x = torch.randn(2, 3, 8, 8)
    with task_precision(TrainParams(precision="bf16"), "cpu"):
        before = conv(x)
        with torch.no_grad():
            conv.weight.mul_(-1.0)
        after = conv(x)
    with torch.no_grad():
        expected = torch.nn.functional.conv2d(x.bfloat16(), conv.weight.bfloat16(), conv.bias.bfloat16())
    assert not torch.allclose(before, after)
    assert torch.equal(after, expected)


def test_bf16_local_training_follows_fp32_training() -> None:
    from dataclasses import replace

    from nestling.edge.procedures import ClientData
    from nestling.edge.trainer import run_task
    from nestling.server.strategies import StrategyContext, create_strategy
    from nestling.server.strategies.base import DeviceInfo

    ctx = StrategyContext(
        arch="tinycnn",
        num_classes=4,
        in_channels=1,
        image_size=8,
        num_clients=1,
        total_rounds=1,
        local={"local_steps": 30, "batch_size": 16, "lr": 0.1},
    )
    strategy = create_strategy("fedavg", ctx)
    task = strategy.assign(0, [DeviceInfo("dev-0", 0, 64)])["dev-0"]
    generator = torch.Generator().manual_seed(1)
    y = torch.arange(64) % 4
    x = torch.randn(64, 1, 8, 8, generator=generator) * 0.5 + y.view(-1, 1, 1, 1).float()
    data = ClientData(x, y)
    fp32 = run_task(task, data)
    bf16 = run_task(replace(task, hparams={**task.hparams, "precision": "bf16"}), data)
    # Measured: 1.436 vs 1.437; with stale bf16 weight copies (only BN and bias learning) it was 1.552.
    assert abs(bf16.metrics["loss_mean"] - fp32.metrics["loss_mean"]) < 0.03 * fp32.metrics["loss_mean"]
    for key, start in task.weights.items():
        if key.endswith("conv.weight"):
            moved32, moved16 = (fp32.weights[key] - start).flatten(), (bf16.weights[key] - start).flatten()
            assert torch.nn.functional.cosine_similarity(moved32, moved16, dim=0) > 0.9, key


def test_unknown_precision_is_refused_with_the_allowed_values() -> None:
    with (
        pytest.raises(ConfigError, match="precision must be one of fp32, bf16"),
        task_precision(TrainParams(precision="fp16"), "cpu"),
    ):
        pass
    with pytest.raises(ConfigError, match="precision must be one of fp32, bf16"):
        load_config(None, {"train.precision": "int4"})


def test_channels_last_converts_convolution_weights() -> None:
    model = build(SubmodelSpec(ModelConfig("tinycnn", num_classes=5, image_size=8)))
    apply_memory_format(model, TrainParams(channels_last=True))
    assert model.stem.conv.weight.is_contiguous(memory_format=torch.channels_last)


def test_run_config_puts_precision_and_layout_into_tasks_only_when_set() -> None:
    default = load_config(None, {}).train.local_hparams()
    assert "precision" not in default and "channels_last" not in default
    fast = load_config(None, {"train.precision": "bf16", "train.channels_last": True}).train.local_hparams()
    assert fast["precision"] == "bf16" and fast["channels_last"] is True
