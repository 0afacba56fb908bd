"""How a model executes on this device: numeric precision of the forward pass and memory format.

Both are speed choices, not method choices: `precision = "bf16"` runs the forward pass under autocast
(weights, optimiser state and what is uploaded stay float32), which CPUs with bf16 matrix units
(Intel AMX / AVX-512 BF16, recent Arm cores) and Ampere-class GPUs such as Jetson Orin run several
times faster; `channels_last` stores convolution weights and activations as NHWC, which oneDNN
and cuDNN prefer. Each is a task hyper-parameter, so every device and backend of a run agrees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from nestling.config import PRECISIONS
from nestling.errors import ConfigError
from nestling.task_params import TrainParams


def check_precision(precision: str) -> str:
    """The precision, or a ConfigError naming the allowed values (fp16 needs loss scaling: not offered)."""
    if precision not in PRECISIONS:
        raise ConfigError(f"[train] precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


@contextlib.contextmanager
def task_precision(hp: TrainParams, device: torch.device | str) -> Iterator[None]:
    """Autocast for the task's precision (a no-op for fp32). It wraps a whole local procedure, so
    every forward path (features, exits, auxiliary models) is covered; backward ops then run in the
    dtype their forward used, and losses such as cross-entropy autocast to float32.

    The weight-cast cache is off: autocast otherwise keeps each parameter's bf16 copy until the
    outermost autocast region exits, and this region spans every optimiser step of the procedure, so
    every forward after the first would run on the weights as they were downloaded."""
    precision = check_precision(hp.precision)
    if precision == "fp32":
        yield
        return
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, cache_enabled=False):
        yield


def apply_memory_format(model: nn.Module, hp: TrainParams) -> None:
    """Store a built model's weights as NHWC when the task asks for channels-last."""
    if hp.channels_last:
        model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # missing from torch's stubs
