"""Classifier heads: the final head, the kernel's plain exit, and the registry of the exit heads methods bring.

An exit head follows a chosen block (`ModelConfig.exit_points`); `ModelConfig.exit_kind` names which kind. The
kernel knows one kind, "linear" (a normalised pool → linear, METHODS §1.5). A method with its own exits (ScaleFL
§6.a.4, DepthFL §7.3, FeDepth §3.a.8 under nestling/methods/) registers an `ExitHead` under the name its
checkpoints carry, so the kernel never names a method.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from nestling.errors import ConfigError
from nestling.models.context import BuildContext

ExportKit = Any  # nestling.export.standalone.KIT (the kernel does not import export)


class PoolClassifier(nn.Module):
    """[BN [→ ReLU] →] global average pool → linear. Post-activation ResNets skip the norm; FeDepth's
    auxiliary heads (METHODS §3.a.8) skip the ReLU."""

    def __init__(
        self, ctx: BuildContext, global_channels: int, *, with_norm: bool, relu: bool = True
    ) -> None:
        super().__init__()
        self.scale = ctx.scaler() if with_norm else None  # HeteroFL: a Scaler in front of every norm
        self.norm = ctx.norm(global_channels) if with_norm else None
        self.relu = relu
        self.fc = ctx.classifier(global_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(self.scale(x) if self.scale is not None else x)
            x = F.relu(x) if self.relu else x
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class TokenClassifier(nn.Module):
    """ViT head: LayerNorm → class token → linear."""

    def __init__(self, ctx: BuildContext, dim: int) -> None:
        super().__init__()
        self.norm = ctx.layer_norm(dim)
        self.fc = ctx.classifier(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x)[:, 0])


class ExitHead:
    """One kind of exit head: how it is built after a block, and (when the family cannot) how export folds it.

    Subclasses register with `@register_exit_head("name")`; `ModelConfig.exit_kind` selects one by that name.
    """

    name: str = ""

    def build(
        self, ctx: BuildContext, global_channels: int, final_channels: int, *, preact: bool
    ) -> nn.Module:
        """The exit after a block emitting `global_channels`; `final_channels` is the last stage's width."""
        raise NotImplementedError(f"exit head '{self.name}' does not build")

    def standalone(self, part: nn.Module, kit: ExportKit) -> nn.Module | None:
        """The folded inference form of `part` if this kind built it, else None (export asks every kind)."""
        return None


_EXIT_HEADS: dict[str, ExitHead] = {}
H = TypeVar("H", bound=Callable[[], ExitHead])


def register_exit_head(name: str) -> Callable[[H], H]:
    """Decorator: register the exit head `factory()` returns (an ExitHead subclass, usually) under `name`."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"an exit head is registered under a non-empty name, got {name!r}")

    def register(factory: H) -> H:
        head = factory()
        if not isinstance(head, ExitHead):
            raise ConfigError(f"{getattr(factory, '__name__', factory)!r} must return an ExitHead")
        if name in _EXIT_HEADS:
            raise ConfigError(f"[model] exit head '{name}' is registered twice")
        head.name = name
        _EXIT_HEADS[name] = head
        return factory

    return register


def unregister_exit_head(name: str) -> None:
    """Remove an exit head (tests that register a throw-away kind clean up with this)."""
    _EXIT_HEADS.pop(name, None)


def registered_exit_heads() -> dict[str, ExitHead]:
    """Every registered exit head by name, in registration order."""
    return dict(_EXIT_HEADS)


def exit_head(kind: str) -> ExitHead:
    """The registered exit head `kind`, or a ConfigError naming the known kinds."""
    try:
        return _EXIT_HEADS[kind]
    except (KeyError, TypeError):
        known = ", ".join(_EXIT_HEADS)
        hint = (
            "" if len(_EXIT_HEADS) > 1 else "; the methods' exit heads register on `import nestling.methods`"
        )
        raise ConfigError(f"[model] unknown exit_kind {kind!r} (known: {known}{hint})") from None


def make_exit(ctx: BuildContext, global_channels: int, final_channels: int, *, preact: bool) -> nn.Module:
    """The exit head of the model config's `exit_kind` for a block emitting `global_channels`."""
    return exit_head(ctx.model.exit_kind).build(ctx, global_channels, final_channels, preact=preact)


def standalone_exit(part: nn.Module, kit: ExportKit) -> nn.Module | None:
    """The folded form of an exit head a registered kind built, or None when no kind claims `part`."""
    for head in _EXIT_HEADS.values():
        converted = head.standalone(part, kit)
        if converted is not None:
            return converted
    return None


@register_exit_head("linear")
class LinearExit(ExitHead):
    """The kernel's exit: BN → ReLU → global average pool → linear (METHODS §1.5); the family folds it."""

    def build(
        self, ctx: BuildContext, global_channels: int, final_channels: int, *, preact: bool
    ) -> nn.Module:
        return PoolClassifier(ctx, global_channels, with_norm=True)
