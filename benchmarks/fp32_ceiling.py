"""How fast could any engine train vs_flower's ResNet-20 step in fp32 on this CPU? A roofline from its convolutions.

Records every convolution of one ResNet-20 training step (batch 32, CIFAR shape), then times each one alone
— forward, gradient of the input (not for the stem, whose input needs none) and gradient of the weights —
in oneDNN's channels-last kernels, one thread, and compares the achieved GFLOP/s with this core's fp32
matrix-multiply peak. The sum of those times is what a step costs if batch norm, ReLU, the loss and the
optimiser were free and every convolution ran as fast as it does alone with hot caches: an upper bound on
samples/s for any fp32 engine that computes the same convolutions. It is printed next to the textbook loop
(eager NCHW: what Flower's clients run) and Nestling's compiled channels-last step, timed in this process.
Ends with `conv_peak_fraction=… ceiling_over_textbook=… compiled_over_textbook=…`.
Run: OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.fp32_ceiling
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nestling.models.config import ModelConfig
from nestling.models.zoo import build
from nestling.spec import SubmodelSpec

SPEC = SubmodelSpec(ModelConfig("resnet20", num_classes=10, in_channels=3, image_size=32))


@dataclass(frozen=True)
class ConvCall:
    """One convolution of the step: its input shape, weight shape, stride and padding."""

    input_shape: tuple[int, ...]
    weight_shape: tuple[int, ...]
    stride: tuple[int, int]
    padding: tuple[int, int]
    needs_input_grad: bool

    def flops(self) -> float:
        """Multiply-adds × 2 of the forward pass (each backward pass costs the same)."""
        n, _, h, w = self.input_shape
        out_c, in_c, kh, kw = self.weight_shape
        oh = (h + 2 * self.padding[0] - kh) // self.stride[0] + 1
        ow = (w + 2 * self.padding[1] - kw) // self.stride[1] + 1
        return 2.0 * n * oh * ow * out_c * in_c * kh * kw


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median of `repeats` timings after a warm-up: robust to a busy neighbour on a shared box."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def record_convolutions(batch: int) -> list[ConvCall]:
    """The convolutions one forward pass of the model makes, in order."""
    model = build(SPEC)
    calls: list[ConvCall] = []

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...], _out: torch.Tensor) -> None:
        assert isinstance(module, nn.Conv2d)
        calls.append(
            ConvCall(
                tuple(args[0].shape),
                tuple(module.weight.shape),
                module.stride,
                module.padding,
                needs_input_grad=len(calls) > 0,
            )
        )

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Conv2d)]
    model(torch.randn(batch, 3, 32, 32))
    for handle in handles:
        handle.remove()
    return calls


def conv_ms(call: ConvCall, repeats: int) -> float:
    """Forward + backward time of one convolution alone, channels-last, one thread."""
    x = torch.randn(call.input_shape).contiguous(memory_format=torch.channels_last)
    weight = torch.randn(call.weight_shape).contiguous(memory_format=torch.channels_last)
    out = F.conv2d(x, weight, stride=call.stride, padding=call.padding)
    grad = torch.randn_like(out)
    mask = [call.needs_input_grad, True, False]

    def backward() -> object:
        return torch.ops.aten.convolution_backward(
            grad, x, weight, None, list(call.stride), list(call.padding), [1, 1], False, [0, 0], 1, mask
        )

    return median_ms(
        lambda: F.conv2d(x, weight, stride=call.stride, padding=call.padding), repeats
    ) + median_ms(backward, repeats)


def matmul_peak_gflops(repeats: int) -> float:
    """This core's fp32 GEMM rate on a large square product: the practical ceiling of any convolution."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    return 2 * 1024**3 / median_ms(lambda: a @ b, repeats) / 1e6


def step_ms(batch: int, channels_last: bool, compiled: bool, repeats: int) -> float:
    """One SGD training step of the whole model, as the textbook loop or Nestling's fast path runs it."""
    model = build(SPEC)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    if compiled:
        model.compile()

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(5):  # compilation and allocator warm-up
        step()
    return median_ms(step, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=30)
    a = parser.parse_args()
    torch.set_num_threads(1)
    peak = matmul_peak_gflops(a.repeats)
    calls = record_convolutions(a.batch)
    per_call = [conv_ms(call, a.repeats) for call in calls]
    flops = sum(c.flops() * (3 if c.needs_input_grad else 2) for c in calls)
    conv_total = sum(per_call)
    textbook = step_ms(a.batch, channels_last=False, compiled=False, repeats=a.repeats)
    compiled = step_ms(a.batch, channels_last=True, compiled=True, repeats=a.repeats)
    achieved = flops / conv_total / 1e6
    print(f"fp32 GEMM peak, 1 thread: {peak:.0f} GFLOP/s")
    print(
        f"{len(calls)} convolutions, {flops / 1e9:.2f} GFLOP per step: {conv_total:.1f} ms alone "
        f"({achieved:.0f} GFLOP/s, {achieved / peak:.0%} of peak)"
    )
    for name, ms in (
        ("convolutions alone (ceiling)", conv_total),
        ("textbook step (eager, NCHW)", textbook),
        ("Nestling step (compiled, NHWC)", compiled),
    ):
        print(f"  {name:<32} {ms:6.1f} ms/step  {1000 * a.batch / ms:5.0f} samples/s per core")
    print(
        f"conv_peak_fraction={achieved / peak:.3f} ceiling_over_textbook={textbook / conv_total:.3f} "
        f"compiled_over_textbook={textbook / compiled:.3f}"
    )


if __name__ == "__main__":
    main()
