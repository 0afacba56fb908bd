"""What a strategy deploys: the submodel each board gets at the end of a run, and every deployable submodel
self-described in each checkpoint, so that export and boards never re-create the strategy."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from nestling.checkpoint_io import pack_deployables
from nestling.eval_target import EvalTarget
from nestling.models.config import ModelConfig
from nestling.server.strategies.context import DeviceInfo
from nestling.spec import SubmodelSpec


class Deployment:
    """Defaults for a method with one global model whose deployables are its eval targets."""

    model: ModelConfig
    global_state: dict[str, torch.Tensor]

    @abstractmethod
    def eval_targets(self) -> list[EvalTarget]:
        """Every submodel the method reports accuracy for, smallest first."""

    def deploy_spec(self, device: DeviceInfo, last_round: int) -> SubmodelSpec:
        """The submodel a device deploys when the run ends (server/deployables.py): by default the largest
        evaluated one."""
        return self.eval_targets()[-1].spec

    def global_export_state(self) -> dict[str, torch.Tensor]:
        """The full model's weights as deployed (NeFL: consistent weights + the largest submodel's BN)."""
        return self.global_state

    def deployables(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Every submodel this method deploys, self-described in each checkpoint so that export and boards
        read it without re-creating the strategy (nestling.checkpoint_io)."""
        return pack_deployables(self.model, self.global_export_state(), self.eval_targets())
