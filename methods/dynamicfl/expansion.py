"""Function-preserving REP expansion of a plain conv into a DBB, branch cuts, BN recalibration (METHODS §5.a.3).

The order of METHODS §5.a.3: new branches start small (last BN γ = 0.01) from random weights; the BNs
inside the block are recalibrated on local batches while the model still computes the plain function;
then the K×K branch becomes "target − Σ other branches" with its BN set to the identity in eval mode
(μ = 0, σ² = 1 − ε so σ is exactly 1: the DECISION of §5.a.3), so the block equals the target conv.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from nestling.methods.dynamicfl.dbb import ORIGINAL, ConvGeometry, DiverseBranchBlock, make_branch
from nestling.methods.dynamicfl.transforms import KernelBias, add_branches

LAST_BN_GAMMA = 0.01  # METHODS §5.a.3 step 1: new branches enter at 1% of the signal
RECALIBRATION_ITERATIONS = 20  # METHODS §5.a.7: BN recalibration over 20 local batches


def init_branch(
    branch: nn.Module, generator: torch.Generator | None, last_gamma: float = LAST_BN_GAMMA
) -> None:
    """A new branch: conv weights ~ N(0, 2/(k_h·k_w·C_out)), biases 0, BN γ=1 β=0 (last BN γ small), fresh stats."""
    with torch.no_grad():
        for module in branch.modules():
            if isinstance(module, nn.Conv2d):
                kh, kw = module.kernel_size
                std = math.sqrt(2.0 / (kh * kw * module.out_channels))
                module.weight.normal_(0.0, std, generator=generator)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.BatchNorm2d):
                module.reset_parameters()
        last_bn: nn.BatchNorm2d = branch.last_bn  # type: ignore[assignment]
        last_bn.weight.fill_(last_gamma)


def absorb(dbb: DiverseBranchBlock, kernel: torch.Tensor, bias: torch.Tensor) -> None:
    """Make `dbb` equal the conv (kernel, bias) in eval mode by rewriting only its K×K branch.

    K×K conv ← target − Σ other branches' equivalents (their current running statistics); the K×K BN
    becomes the identity: γ = 1, β = 0, μ = 0 and σ² = 1 − ε, so √(σ² + ε) is exactly 1.
    """
    with torch.no_grad():
        others = [eq for name, eq in dbb.branch_equivalents().items() if name != ORIGINAL]
        original = dbb.original
        weight = original.conv.weight
        if others:
            other_kernel, other_bias = add_branches(others)
        else:
            other_kernel, other_bias = torch.zeros_like(weight), torch.zeros_like(kernel[:, 0, 0, 0])
        weight.copy_(kernel.to(weight) - other_kernel.to(weight))
        assert original.conv.bias is not None
        original.conv.bias.copy_(bias.to(weight) - other_bias.to(weight))
        bn = original.bn
        bn.weight.fill_(1.0)
        bn.bias.zero_()
        assert (
            bn.running_mean is not None and bn.running_var is not None and bn.num_batches_tracked is not None
        )
        bn.running_mean.zero_()
        bn.running_var.fill_(1.0 - bn.eps)
        bn.num_batches_tracked.zero_()


def expand_conv(
    conv: nn.Conv2d,
    branches: Iterable[str] | None = None,
    *,
    inner_width: int | None = None,
    generator: torch.Generator | None = None,
    last_gamma: float = LAST_BN_GAMMA,
) -> DiverseBranchBlock:
    """REP step 1 + 3 for one conv: a DBB (on the conv's device and dtype) that equals `conv` in eval mode.

    Without recalibration the new branches' BNs keep fresh statistics (μ = 0, σ² = 1); `recalibrate`
    measures real ones on local batches and re-absorbs, keeping the function.
    """
    geometry = ConvGeometry.of(conv)
    weight = conv.weight.detach()
    bias = (
        conv.bias.detach()
        if conv.bias is not None
        else torch.zeros(conv.out_channels, dtype=weight.dtype, device=weight.device)
    )
    dbb = DiverseBranchBlock(geometry, branches, inner_width=inner_width).to(
        device=weight.device, dtype=weight.dtype
    )
    dbb.train(conv.training)  # the block takes the conv's place, and its mode
    for name in dbb.branch_names:
        if name != ORIGINAL:
            init_branch(dbb.branch(name), generator, last_gamma)
    absorb(dbb, weight, bias)
    return dbb


def grow_branches(
    dbb: DiverseBranchBlock,
    names: Sequence[str],
    *,
    generator: torch.Generator | None = None,
    last_gamma: float = LAST_BN_GAMMA,
) -> None:
    """Add new random branches to an existing DBB without changing its eval-mode function (DYMM expansion)."""
    new = [name for name in names if name not in dbb.branches]
    if not new:
        return
    available = dbb.geometry.available_branches()
    missing = [name for name in new if name not in available]
    if missing:
        raise ValueError(
            f"branches {missing} are not available for {dbb.geometry} (available: {list(available)})"
        )
    target = dbb.equivalent()
    reference = dbb.original.conv.weight
    order = [name for name in available if name in dbb.branches or name in new]
    modules = {
        name: dbb.branches[name] if name in dbb.branches else make_branch(name, dbb.geometry, dbb.inner_width)
        for name in order
    }
    for name in new:
        modules[name].to(device=reference.device, dtype=reference.dtype).train(dbb.training)
        init_branch(modules[name], generator, last_gamma)
    dbb.branches = nn.ModuleDict(modules)
    dbb.branches.train(dbb.training)
    absorb(dbb, *target)


def cut_branches(dbb: DiverseBranchBlock, names: Sequence[str]) -> None:
    """Fuse redundant branches into the K×K branch and drop them (DYMM's merge; function-preserving)."""
    if ORIGINAL in names:
        raise ValueError("the original K×K branch cannot be cut (it carries the plain conv)")
    unknown = [name for name in names if name not in dbb.branches]
    if unknown:
        raise KeyError(f"this DBB has no branches {unknown} (it has: {', '.join(dbb.branch_names)})")
    target = dbb.equivalent()
    for name in names:
        del dbb.branches[name]
    absorb(dbb, *target)


def recalibrate(
    model: nn.Module,
    blocks: Sequence[DiverseBranchBlock],
    batches: Iterable[torch.Tensor],
    *,
    iterations: int = RECALIBRATION_ITERATIONS,
    targets: Sequence[KernelBias] | None = None,
) -> int:
    """REP step 2: recalibrate the BNs inside `blocks` on local batches, then re-absorb each block's function.

    Up to `iterations` no-grad forward passes of the whole model (every other module in eval mode), the
    blocks' BNs in train mode with a cumulative average (momentum None, restored afterwards). During the
    passes each block outputs its target conv (DECISION: so every block, and every block after it, sees the
    activations of the plain model, not of a half-built one). `targets` defaults to each block's current
    eval-mode equivalent. Returns the number of batches used.
    """
    if targets is not None and len(targets) != len(blocks):
        raise ValueError(f"{len(targets)} targets for {len(blocks)} blocks")
    goals = list(targets) if targets is not None else [block.equivalent() for block in blocks]
    modes = {module: module.training for module in model.modules()}
    norms = [m for block in blocks for m in block.modules() if isinstance(m, nn.BatchNorm2d)]
    momenta = [bn.momentum for bn in norms]
    hooks = []
    used = 0
    try:
        model.eval()
        for bn in norms:
            bn.reset_running_stats()
            bn.momentum = None
            bn.train()
        for block, (kernel, bias) in zip(blocks, goals):
            hooks.append(block.register_forward_hook(_target_output(block, kernel, bias)))
        with torch.no_grad():
            for batch in batches:
                if used >= iterations:
                    break
                model(batch)
                used += 1
    finally:
        for hook in hooks:
            hook.remove()
        for bn, momentum in zip(norms, momenta):
            bn.momentum = momentum
        for module, mode in modes.items():
            module.train(mode)
    for block, (kernel, bias) in zip(blocks, goals):
        absorb(block, kernel, bias)
    return used


def _target_output(
    block: DiverseBranchBlock, kernel: torch.Tensor, bias: torch.Tensor
) -> Callable[[nn.Module, tuple[torch.Tensor, ...], torch.Tensor], torch.Tensor]:
    """A forward hook replacing a calibrating block's output with its target conv's output."""
    g = block.geometry

    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        return F.conv2d(inputs[0], kernel.to(inputs[0]), bias.to(inputs[0]), g.stride, g.padding, 1, g.groups)

    return hook
