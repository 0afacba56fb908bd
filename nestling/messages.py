"""Typed Task / Result records exchanged between the coordinator and devices (schema-versioned)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

SCHEMA_VERSION = 1


@dataclass
class Task:
    """What one device must do in one round: train `spec` with `procedure` from `weights`."""

    round: int
    device_id: str
    spec: dict[str, Any]  # SubmodelSpec.to_dict(); the device builds exactly this submodel
    weights: dict[str, torch.Tensor]  # only the slice the device trains, keyed like build(spec)
    procedure: str  # name registered in edge.procedures
    hparams: dict[str, Any] = field(default_factory=dict)
    deadline_s: float | None = None
    task_id: str = ""
    model_id: str = "global"  # which server model the slice came from (FedTrans keeps several)

    @property
    def spec_id(self) -> str:
        from nestling.spec import SubmodelSpec

        return SubmodelSpec.from_dict(self.spec).id


@dataclass
class Result:
    """What a device sends back: trained tensors of its slice plus what it measured."""

    round: int
    device_id: str
    task_id: str
    spec_id: str
    weights: dict[str, torch.Tensor]
    num_samples: int
    metrics: dict[str, Any] = field(default_factory=dict)  # loss curve, train_seconds, peak_memory_bytes, ...
    model_id: str = "global"
