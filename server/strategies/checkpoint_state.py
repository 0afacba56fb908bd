"""A strategy's checkpoint state when it holds one global model: its tensors under `global/`, no metadata."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from nestling.errors import ConfigError


class GlobalModelState:
    """`state_tensors` / `state_meta` / `load_state` for one global model (methods with more extend them)."""

    name: ClassVar[str]
    global_state: dict[str, torch.Tensor]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"global/{k}": v for k, v in self.global_state.items()}

    def state_meta(self) -> dict[str, Any]:
        return {}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        for key in self.global_state:
            stored = tensors.get(f"global/{key}")
            if stored is None or stored.shape != self.global_state[key].shape:
                raise ConfigError(f"checkpoint does not match the {self.name} model at tensor '{key}'")
            self.global_state[key] = stored.clone()
