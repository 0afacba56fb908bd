"""Precision and memory format are task hyper-parameters that every backend honours (edge.execution)."""

from __future__ import annotations

import pytest
import torch

from edge.execution import apply_memory_format, task_precision
from nestling.config import load_config
from nestling.errors import ConfigError
from nestling.models.config import ModelConfig
from nestling.models.zoo import build
from nestling.spec import SubmodelSpec


def test_bf16_runs_convolutions_in_bfloat16_and_fp32_does_not() -> None:
    conv = torch.nn.Conv2d(3, 4, 3)
    x = torch.randn(2, 3, 8, 8)
    with task_precision({"precision": "bf16"}, "cpu"):
        assert conv(x).dtype == torch.bfloat16
    with task_precision({}, "cpu"):
        assert conv(x).dtype == torch.float32


def test_unknown_precision_is_refused_with_the_allowed_values() -> None:
    with pytest.raises(ConfigError, match="precision must be one of fp32, bf16"):
        with task_precision({"precision": "fp16"}, "cpu"):
            pass
    with pytest.raises(ConfigError, match="precision must be one of fp32, bf16"):
        load_config(None, {"train.precision": "int4"})


def test_channels_last_converts_convolution_weights() -> None:
    model = build(SubmodelSpec(ModelConfig("tinycnn", num_classes=5, image_size=8)))
    apply_memory_format(model, {"channels_last": True})
    assert model.stem.conv.weight.is_contiguous(memory_format=torch.channels_last)


def test_run_config_puts_precision_and_layout_into_tasks_only_when_set() -> None:
    default = load_config(None, {}).train.local_hparams()
    assert "precision" not in default and "channels_last" not in default
    fast = load_config(None, {"train.precision": "bf16", "train.channels_last": True}).train.local_hparams()
    assert fast["precision"] == "bf16" and fast["channels_last"] is True
