"""K clients of one convolutional spec as one wide network, so a CPU trains them in one pass.

Client k's channels occupy the k-th slice of every activation ([batch, K·C, H, W]); each convolution
becomes a grouped convolution (groups × K), each BatchNorm normalises K·C channels (so per-client batch
statistics and per-client running statistics), the classifier is a per-client linear map, and each
residual step size is a per-client scalar broadcast over that client's channels. Nothing crosses
client boundaries, so gradients, SGD updates and BN statistics are exactly each client's own.

Why not `torch.func.vmap`: on CPU its batching rules re-layout activations around every layer and ran
slower than client-by-client training; a grouped network is one plain module that oneDNN runs with
few, larger kernels (and that autocast and channels-last apply to as to any model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from nestling.models.family import family_of
from nestling.models.layers import Scaler, SlimBatchNorm2d, SlimConv2d, SlimLinear
from nestling.models.net import ScalableNet

# Layers grouping knows how to widen, or that act per channel (a family declares its own forwards groupable).
_GROUPABLE_LAYERS = (
    SlimConv2d,
    SlimBatchNorm2d,
    SlimLinear,
    Scaler,
    nn.ReLU,
    nn.Sigmoid,
    nn.Upsample,
    nn.Identity,
    nn.Sequential,
    nn.ModuleList,
    nn.ModuleDict,
)


class NotGroupable(ValueError):
    """The model has a layer whose forward mixes channels across what would be client boundaries."""


class GroupedLinear(nn.Module):
    """K independent linear maps: input [B, K·in] (client-major), output [B, K·out]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)  # [K, out, in]
        self.bias = nn.Parameter(bias) if bias is not None else None  # [K, out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, _, features = self.weight.shape
        out = torch.einsum("bki,koi->bko", x.reshape(x.shape[0], k, features), self.weight)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(x.shape[0], -1)


def _broadcast_step(module: nn.Module, _inputs: object) -> None:
    """Before each forward: the block's per-client step sizes, repeated over each client's channels."""
    grouped = module.step_grouped
    channels = cast(torch.Tensor, module.step_channels)  # a buffer of per-client channel counts
    assert isinstance(grouped, torch.Tensor)
    module.step = grouped.repeat_interleave(channels).view(1, -1, 1, 1)


def _stepped(module: nn.Module) -> bool:
    """A residual block whose scalar step size multiplies `stepped_channels()` channels (blocks.py)."""
    return "step" in module._parameters and callable(getattr(module, "stepped_channels", None))


@dataclass(frozen=True)
class _Slot:
    """Where client k's copy of one original state entry lives in the grouped network."""

    grouped_key: str
    kind: str  # "rows": split dim 0 into K equal parts; "index": take [k]; "count": integer BN counter


def groupable(model: nn.Module) -> bool:
    """Whether `group_clients` can train this model: its family says its forwards only mix channels within
    a layer grouping widens (ModelFamily.groupable), every leaf layer is one of those, no per-width BN."""
    if not isinstance(model, ScalableNet) or not family_of(model.arch).groupable:
        return False
    for module in model.modules():
        if isinstance(module, SlimBatchNorm2d) and module.stats == "per_width":
            return False
        if isinstance(module, _GROUPABLE_LAYERS):
            continue
        leaf = next(module.children(), None) is None
        own = set(module._parameters) - ({"step"} if _stepped(module) else set())
        if leaf or own:
            return False
    return True


class GroupedClients:
    """The grouped network of K clients' states and the way back to each client's own state dict."""

    def __init__(self, template: ScalableNet, states: list[dict[str, torch.Tensor]]) -> None:
        if not groupable(template):
            raise NotGroupable(f"{template.arch} has layers that mix channels; train its clients one by one")
        self.k = len(states)
        self.keys = list(states[0].keys())
        self.slots: dict[str, _Slot] = {}
        self.net = template
        for name, module in list(template.named_modules()):
            replacement = self._group(name, module, states)
            if replacement is not None:
                _set_child(template, name, replacement)
        missing = [key for key in self.keys if key not in self.slots]
        if missing:
            raise NotGroupable(f"no grouped copy of {missing[:3]}")

    def _group(self, name: str, module: nn.Module, states: list[dict[str, torch.Tensor]]) -> nn.Module | None:
        prefix = f"{name}." if name else ""

        def stacked(key: str) -> torch.Tensor:
            return torch.cat([s[prefix + key] for s in states], dim=0)

        if isinstance(module, SlimConv2d):
            pair = tuple[int, int]
            conv = nn.Conv2d(
                module.in_channels * self.k,
                module.out_channels * self.k,
                cast(pair, module.kernel_size),
                cast(pair, module.stride),
                cast("str | pair", module.padding),
                cast(pair, module.dilation),
                module.groups * self.k,
                bias=module.bias is not None,
            )
            with torch.no_grad():
                conv.weight.copy_(stacked("weight"))
                if conv.bias is not None:
                    conv.bias.copy_(stacked("bias"))
            conv.weight.requires_grad_(module.weight.requires_grad)
            self._map(prefix, ("weight", "bias") if conv.bias is not None else ("weight",), "rows")
            return conv
        if isinstance(module, SlimBatchNorm2d):
            track = module.track_running_stats
            norm = nn.BatchNorm2d(
                module.num_features * self.k, module.eps, module.momentum, module.affine, track
            )
            with torch.no_grad():
                for key in ("weight", "bias", "running_mean", "running_var") if track else ("weight", "bias"):
                    getattr(norm, key).copy_(stacked(key))
            self._map(
                prefix,
                ("weight", "bias", "running_mean", "running_var") if track else ("weight", "bias"),
                "rows",
            )
            if track:
                counts = {int(s[prefix + "num_batches_tracked"]) for s in states}
                if len(counts) != 1:
                    raise NotGroupable("clients' BatchNorm counters differ")
                assert norm.num_batches_tracked is not None
                norm.num_batches_tracked.fill_(counts.pop())
                self.slots[prefix + "num_batches_tracked"] = _Slot(prefix + "num_batches_tracked", "count")
            return norm
        if isinstance(module, SlimLinear):
            weight = torch.stack([s[prefix + "weight"] for s in states])
            bias = torch.stack([s[prefix + "bias"] for s in states]) if module.bias is not None else None
            self._map(prefix, ("weight", "bias") if bias is not None else ("weight",), "index")
            return GroupedLinear(weight, bias)
        if _stepped(module):
            learnable = bool(module._parameters["step"].requires_grad)  # type: ignore[union-attr]
            channels = module.stepped_channels()  # type: ignore[operator]
            del module._parameters["step"]
            module.step_grouped = nn.Parameter(torch.cat([s[prefix + "step"] for s in states]), learnable)
            module.step_channels = channels
            module.register_forward_pre_hook(_broadcast_step)
            self.slots[prefix + "step"] = _Slot(prefix + "step_grouped", "rows")
        return None

    def _map(self, prefix: str, keys: tuple[str, ...], kind: str) -> None:
        for key in keys:
            self.slots[prefix + key] = _Slot(prefix + key, kind)

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """Per-client batches [K, B, C, H, W] as one grouped batch [B, K·C, H, W]."""
        k, b, c, h, w = x.shape
        return x.permute(1, 0, 2, 3, 4).reshape(b, k * c, h, w)

    def per_client(self, logits: torch.Tensor) -> torch.Tensor:
        """Grouped logits [B, K·classes] as [B, K, classes]."""
        return logits.view(logits.shape[0], self.k, -1)

    def client_states(self) -> list[dict[str, torch.Tensor]]:
        """Each client's trained state dict, with the original keys, shapes and dtypes."""
        grouped = self.net.state_dict()
        out: list[dict[str, torch.Tensor]] = [{} for _ in range(self.k)]
        for key in self.keys:
            slot = self.slots[key]
            value = grouped[slot.grouped_key].detach()
            for k in range(self.k):
                if slot.kind == "rows":
                    part = value.view(self.k, -1, *value.shape[1:])[k]
                elif slot.kind == "index":
                    part = value[k]
                else:
                    part = value
                out[k][key] = part.to("cpu").clone(memory_format=torch.contiguous_format)
        return out


def _set_child(root: nn.Module, dotted: str, new: nn.Module) -> None:
    parent_name, _, child = dotted.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def per_client_cross_entropy(
    logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean CE of each client ([B, K, classes] logits, [K, B] labels) → [K]; `mask` [K, classes] zeroes
    the logits of classes a client does not hold (METHODS §7.1), as the sequential procedure does."""
    if mask is not None:
        logits = logits.masked_fill(~mask.unsqueeze(0), 0.0)
    return F.cross_entropy(logits.permute(0, 2, 1).float(), y.t(), reduction="none").mean(dim=0)


def per_client_clip(params: list[nn.Parameter], k: int, max_norm: float) -> None:
    """clip_grad_norm_ of each client over its own slice of every gradient (dim 0 is client-major)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    squares = torch.stack([g.reshape(k, -1).pow(2).sum(dim=1) for g in grads]).sum(dim=0)
    coef = (max_norm / (squares.sqrt() + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.repeat_interleave(g.shape[0] // k).view(-1, *([1] * (g.dim() - 1))))
