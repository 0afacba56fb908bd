"""FedDyn's client side (Acar et al., ICLR 2021), as DepthFL uses it (METHODS §7.3).

The local loss gains −⟨θ, h_k⟩ + (α/2)‖θ − θ_global‖²; after training h_k ← h_k − α(θ_k − θ_global).
h_k persists on the device between its participations (the DeviceStore).
"""

from __future__ import annotations

import torch
from torch import nn

from nestling.edge.procedures.registry import DeviceStore

STORE_KEY = "feddyn_h"


class FedDynTerm:
    """Holds θ_global and h_k for one local run; adds the regulariser and updates h_k at the end."""

    def __init__(self, model: nn.Module, store: DeviceStore, alpha: float) -> None:
        self.alpha = alpha
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self.start = {name: p.detach().clone() for name, p in self.params.items()}
        state: dict[str, torch.Tensor] = store.setdefault(STORE_KEY, {})
        for name, p in self.params.items():
            if name not in state or state[name].shape != p.shape:
                state[name] = torch.zeros_like(p, device="cpu")
        self.state = state
        self.h = {name: state[name].to(p.device) for name, p in self.params.items()}

    def penalty(self) -> torch.Tensor:
        total = next(iter(self.params.values())).new_zeros(())
        for name, p in self.params.items():
            total = (
                total
                - torch.sum(p * self.h[name])
                + 0.5 * self.alpha * torch.sum((p - self.start[name]) ** 2)
            )
        return total

    @torch.no_grad()
    def finish(self) -> None:
        for name, p in self.params.items():
            self.state[name] = (self.h[name] - self.alpha * (p.detach() - self.start[name])).cpu()
