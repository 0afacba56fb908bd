"""Parameter and MAC counts of a submodel, measured by one forward pass with hooks (batch 1)."""

from __future__ import annotations

import torch
from torch import nn

from nestling.models.layers import SlimConv2d, SlimLinear
from nestling.models.net import ScalableNet


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def count_macs(model: ScalableNet, input_shape: tuple[int, int, int]) -> int:
    """Multiply-accumulates of one forward pass on one sample (convs, linears, attention products)."""
    total = 0

    def conv_hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        nonlocal total
        x = inputs[0]
        groups = x.shape[1] if getattr(module, "depthwise", False) else 1
        kernel = int(module.kernel_size[0] * module.kernel_size[1])  # type: ignore[index]
        total += output.numel() // output.shape[0] * (x.shape[1] // groups) * kernel

    def linear_hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        nonlocal total
        total += output.numel() // output.shape[0] * inputs[0].shape[-1]

    def attention_hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        nonlocal total
        x = inputs[0]
        if x.dim() == 3 and hasattr(module, "q"):
            tokens = x.shape[1]
            inner = int(module.q.out_features)  # type: ignore[union-attr, arg-type]
            total += 2 * tokens * tokens * inner  # QKᵀ and attention × V

    handles = []
    for module in model.modules():
        if isinstance(module, (SlimConv2d, nn.Conv2d)):
            handles.append(module.register_forward_hook(conv_hook))
        elif isinstance(module, (SlimLinear, nn.Linear)):
            handles.append(module.register_forward_hook(linear_hook))
        elif module.__class__.__name__ == "EncoderBlock":
            handles.append(module.register_forward_hook(attention_hook))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros(1, *input_shape))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return int(total)
