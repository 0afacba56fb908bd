"""Standalone inference modules: a trained ScalableNet rebuilt from plain torch layers with everything folded.

What the exported graph holds (docs/export.md): only the submodel's physically sliced weights; each
NeFL step size folded into the normalisation before it (s·BN(x) = BN with γ·s, β·s) and that BN folded
into its convolution; ScaleFL's Scaler constant folded into the next BN; skipped blocks reduced to their
projection shortcut or removed; blocks after the last requested output removed.

A family gets its standalone form without writing export code: `plain_copy` (the default of
`ModelFamily.standalone_part`) freezes a copy of each part and rewrites what the kernel inserted over its module
tree — slim convolutions, linears and norms become plain layers holding their kept channels (a BN its inference
statistics), a Scaler its eval-mode constant, and every conv → [Scaler] → BN run inside an `nn.Sequential` one
folded convolution. The part's own forward still runs, so a skipped block keeps its projection shortcut and step
sizes stay constant multiplications. A family overrides `standalone_part` only to fold further (the ResNet and
ViT families fold BN and step sizes into their convolutions and projections everywhere, which channel alignment
for TensorRT needs).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import nestling.methods  # noqa: F401  (the methods' exit heads register how they fold)
from nestling.errors import SpecError
from nestling.export.fold import (
    ChannelAffine,
    bn_affine,
    fold_conv,
    inference_stats,
    plain_linear,
    scale_affine,
    scaler_factor,
)
from nestling.export.plain_layers import (
    Encoder,
    GatedPoolLinear,
    PatchEmbed,
    PoolLinear,
    PreActResidual,
    Residual,
    TokenHead,
)
from nestling.models.family import family_of
from nestling.models.layers import Scaler, SlimBatchNorm2d, SlimConv2d, SlimLayerNorm, SlimLinear
from nestling.models.net import ScalableNet

HEAD = "head"


@dataclass(frozen=True)
class OutputPlan:
    """Which outputs of the submodel the exported graph returns, and under which names.

    taps: outputs of `ScalableNet.forward_all` by name ("exit{block}" or "head"), in depth order.
    names: the graph's output names; a single output is always called "logits".
    combine: "none", or "mean" (DepthFL's ensemble: one output, the mean of every tap's logits).
    """

    taps: tuple[str, ...]
    names: tuple[str, ...]
    combine: str = "none"

    @property
    def exits(self) -> list[int]:
        return [int(t[4:]) for t in self.taps if t != HEAD]


def available_taps(net: ScalableNet) -> list[str]:
    """Every output of the submodel in `forward_all` order."""
    return [f"exit{k}" for k in net.exits] + ([HEAD] if net.head is not None else [])


def plan_outputs(
    net: ScalableNet, *, exit: str | int | None = None, all_exits: bool = False, ensemble: bool = False
) -> OutputPlan:
    """Resolve `--exit K` / `--all-exits` against the outputs this submodel has.

    The default is what the server evaluates: the deepest output, or the mean of all outputs for an
    ensemble method (DepthFL). `exit` is the block index an exit follows, or "head".
    """
    taps = available_taps(net)
    if all_exits and exit is not None:
        raise SpecError("choose either one exit or all exits, not both")
    if all_exits:
        return OutputPlan(tuple(taps), tuple(taps))
    if exit is not None:
        tap = HEAD if str(exit) == HEAD else f"exit{exit}"
        if tap not in taps:
            listed = ", ".join(t if t == HEAD else t[4:] for t in taps)
            raise SpecError(f"this submodel has no exit '{exit}' (its outputs: exits after blocks {listed})")
        return OutputPlan((tap,), ("logits",))
    if ensemble and len(taps) > 1:
        return OutputPlan(tuple(taps), ("logits",), "mean")
    return OutputPlan((taps[-1],), ("logits",))


class StandaloneNet(nn.Module):
    """stem → segments of blocks, each ending where a requested output taps the trunk."""

    def __init__(
        self, stem: nn.Module, segments: list[nn.Module], heads: list[nn.Module], plan: OutputPlan
    ) -> None:
        super().__init__()
        self.stem = stem
        self.segments = nn.ModuleList(segments)
        self.heads = nn.ModuleList(heads)
        self.output_names = list(plan.names)
        self.combine = plan.combine

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        x = self.stem(x)
        outputs = []
        for segment, head in zip(self.segments, self.heads):
            x = segment(x)
            outputs.append(head(x))
        if self.combine == "mean":
            return torch.stack(outputs).mean(0)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)


# -- conversion of each ScalableNet part -----------------------------------------------------------
def fold_chain(modules: list[nn.Module]) -> list[nn.Module]:
    """conv [→ Scaler] [→ BN] runs become one conv; activations and resizes pass through; Sequentials recurse."""
    out: list[nn.Module] = []
    i = 0
    while i < len(modules):
        module = modules[i]
        if isinstance(module, nn.Conv2d):
            factor, j = 1.0, i + 1
            if j < len(modules) and isinstance(modules[j], Scaler):
                factor, j = scaler_factor(modules[j]), j + 1
            norm = modules[j] if j < len(modules) else None
            if isinstance(norm, nn.BatchNorm2d):
                out.append(fold_conv(module, post=bn_affine(norm, factor)))
                j += 1
            else:
                out.append(
                    fold_conv(module, post=_uniform(module.out_channels, factor))
                    if factor != 1.0
                    else fold_conv(module)
                )
            i = j
            continue
        if isinstance(module, nn.Sequential):
            out.extend(fold_chain(list(module)))
        elif isinstance(module, (nn.ReLU, nn.Sigmoid, nn.Upsample, nn.MaxPool2d)):
            out.append(module)
        elif isinstance(module, Scaler):
            if scaler_factor(module) != 1.0:
                raise SpecError("a Scaler that is not followed by a convolution's BN cannot be folded")
        else:
            raise SpecError(f"export cannot fold a {type(module).__name__} inside a layer chain")
        i += 1
    return out


def _uniform(channels: int, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.full((channels,), float(factor), dtype=torch.float64),
        torch.zeros(channels, dtype=torch.float64),
    )


def pre_activation(bn: nn.BatchNorm2d, input_scale: float = 1.0) -> nn.Sequential:
    """[Scaler →] BN → ReLU as a per-channel affine and a ReLU (pre-activation blocks, normalised pool heads)."""
    return nn.Sequential(ChannelAffine(bn_affine(bn, input_scale)), nn.ReLU())


class Scale(nn.Module):
    """y = factor·x: a Scaler's eval-mode constant where no BN follows it inside one Sequential."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = float(factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def plain_batch_norm(bn: nn.BatchNorm2d) -> nn.BatchNorm2d:
    """A plain eval BatchNorm2d over the kept channels with the statistics `bn` normalises with in eval mode."""
    mean, var = inference_stats(bn)
    n = mean.numel()
    out = nn.BatchNorm2d(n, eps=bn.eps, affine=bn.weight is not None)
    assert out.running_mean is not None and out.running_var is not None
    with torch.no_grad():
        out.running_mean.copy_(mean.detach())
        out.running_var.copy_(var.detach())
        if bn.weight is not None and bn.bias is not None:
            out.weight.copy_(bn.weight.detach()[:n])
            out.bias.copy_(bn.bias.detach()[:n])
    return out.eval()


def _plain_layer(module: nn.Module) -> nn.Module | None:
    """The plain replacement of one layer the kernel inserted, or None to keep it (and look inside)."""
    if isinstance(module, SlimConv2d):
        return fold_conv(module)
    if isinstance(module, SlimLinear):
        return plain_linear(module)
    if isinstance(module, SlimBatchNorm2d):
        return plain_batch_norm(module)
    if isinstance(module, SlimLayerNorm):
        out = nn.LayerNorm(module.normalized_shape, eps=module.eps)
        out.load_state_dict(module.state_dict())
        return out
    if isinstance(module, Scaler):
        factor = scaler_factor(module)
        return nn.Identity() if factor == 1.0 else Scale(factor)
    return None


def _make_plain(module: nn.Module) -> None:
    for name, child in list(module.named_children()):
        plain = _plain_layer(child)
        if plain is None:
            _make_plain(child)
        else:
            setattr(module, name, plain)
    if isinstance(module, nn.Sequential):
        _fold_sequential(module)


def _fold_sequential(chain: nn.Sequential) -> None:
    """Fold every conv → [Scale] → BN run of `chain` into its convolution, in place; the Scale and the BN
    become identities, so indices a forward may use stay valid."""
    layers = list(chain)
    i = 0
    while i < len(layers):
        j, factor = i + 1, 1.0
        if type(layers[i]) is nn.Conv2d:
            while j < len(layers) and isinstance(layers[j], (Scale, nn.Identity)):
                between = layers[j]
                factor *= between.factor if isinstance(between, Scale) else 1.0
                j += 1
            conv, bn = layers[i], layers[j] if j < len(layers) else None
            if isinstance(conv, nn.Conv2d) and type(bn) is nn.BatchNorm2d:
                chain[i] = fold_conv(conv, post=bn_affine(bn, factor))
                for k in range(i + 1, j + 1):
                    chain[k] = nn.Identity()
                i = j
        i += 1


@torch.no_grad()
def plain_copy(part: nn.Module) -> nn.Module:
    """The derived standalone form of any part: a frozen eval copy with the kernel's layers made plain."""
    frozen = copy.deepcopy(part).eval()
    plain = _plain_layer(frozen)
    if plain is not None:
        frozen = plain
    else:
        _make_plain(frozen)
    for parameter in frozen.parameters():
        parameter.requires_grad_(False)
    return frozen.eval()


@dataclass(frozen=True)
class StandaloneKit:
    """What a model family's `standalone_part` converts with (the kernel cannot import export itself)."""

    plain_copy: Callable[[nn.Module], nn.Module] = plain_copy
    fold_chain: Callable[[list[nn.Module]], list[nn.Module]] = fold_chain
    fold_conv: Callable[..., nn.Conv2d] = fold_conv
    bn_affine: Callable[..., tuple[torch.Tensor, torch.Tensor]] = bn_affine
    scale_affine: Callable[..., tuple[torch.Tensor, torch.Tensor]] = scale_affine
    scaler_factor: Callable[[nn.Module], float] = scaler_factor
    plain_linear: Callable[..., nn.Linear] = plain_linear
    pre_activation: Callable[..., nn.Sequential] = pre_activation
    ChannelAffine: type[nn.Module] = ChannelAffine
    Residual: type[nn.Module] = Residual
    PreActResidual: type[nn.Module] = PreActResidual
    PoolLinear: type[nn.Module] = PoolLinear
    GatedPoolLinear: type[nn.Module] = GatedPoolLinear
    PatchEmbed: type[nn.Module] = PatchEmbed
    Encoder: type[nn.Module] = Encoder
    TokenHead: type[nn.Module] = TokenHead


KIT = StandaloneKit()


def convert_part(net: ScalableNet, part: nn.Module) -> nn.Module | None:
    """The folded stem, block or head of `net`'s family; None for a block that is an identity in inference."""
    return family_of(net.arch).standalone_part(part, KIT)


def _required(net: ScalableNet, part: nn.Module) -> nn.Module:
    converted = convert_part(net, part)
    if converted is None:
        raise SpecError(f"model family '{net.arch}' turned its {type(part).__name__} into nothing")
    return converted


@torch.no_grad()
def build_standalone(net: ScalableNet, plan: OutputPlan) -> StandaloneNet:
    """The folded, plain-torch equivalent of `net` in eval mode, returning the outputs of `plan`."""
    if net.training:
        raise SpecError("build the standalone module from a model in eval mode (its BN statistics are final)")
    ends = [int(t[4:]) if t != HEAD else len(net.blocks) - 1 for t in plan.taps]
    blocks = [convert_part(net, b) for b in list(net.blocks)[: max(ends) + 1]]
    segments: list[nn.Module] = []
    heads: list[nn.Module] = []
    start = 0
    for tap, end in zip(plan.taps, ends):
        segments.append(nn.Sequential(*[b for b in blocks[start : end + 1] if b is not None]))
        head = net.head if tap == HEAD else net.exits[tap[4:]]
        assert head is not None
        heads.append(_required(net, head))
        start = end + 1
    model = StandaloneNet(_required(net, net.stem), segments, heads, plan).eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


def reference_outputs(net: ScalableNet, plan: OutputPlan, x: torch.Tensor) -> list[torch.Tensor]:
    """The unfolded ScalableNet's outputs for `plan`, in the standalone graph's order and combination.

    Runs only what the plan needs (no blocks after its last tap, no other exits), so it is also the
    fair PyTorch-eager baseline for latency.
    """
    ends = [int(t[4:]) if t != HEAD else len(net.blocks) - 1 for t in plan.taps]
    wanted = set(plan.taps)
    outputs: list[torch.Tensor] = []
    x = net.stem(x)
    for index, block in enumerate(list(net.blocks)[: max(ends) + 1]):
        x = block(x)
        if f"exit{index}" in wanted:
            outputs.append(net.exits[str(index)](x))
    if HEAD in wanted and net.head is not None:
        outputs.append(net.head(x))
    if plan.combine == "mean":
        return [torch.stack(outputs).mean(0)]
    return outputs
