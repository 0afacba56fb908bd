"""EvalTarget: one submodel with its own weights, as the server evaluates it and a board exports it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nestling.spec import SubmodelSpec


@dataclass
class EvalTarget:
    """One submodel to evaluate: its spec and weights, and how its prediction is formed."""

    name: str
    spec: SubmodelSpec
    state: dict[str, torch.Tensor]
    ensemble: bool = False  # DepthFL: mean of all outputs' logits
    static_bn: bool = False  # HeteroFL sBN: recompute BN statistics over the training set first
    active_width: float | None = None  # FjORD: evaluate at this width with its BN statistics
