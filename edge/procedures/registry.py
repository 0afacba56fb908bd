"""Registry of local procedures and the records they exchange with the trainer.

A procedure is registered with the typed record of the hyper-parameters it accepts (nestling.task_params); the
trainer builds that record once from the task and calls the procedure with it, never with the task's JSON dict.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from nestling.errors import ConfigError
from nestling.models.net import ScalableNet
from nestling.task_params import TrainParams


@dataclass
class ClientData:
    """A device's own training samples, already normalised tensors (x: N,C,H,W; y: N)."""

    x: torch.Tensor
    y: torch.Tensor
    augment: str = "none"

    def __len__(self) -> int:
        return int(self.y.shape[0])


class DeviceStore(dict):
    """Small persistent per-device state that survives between rounds on the board
    (m-FeDepth's auxiliary model, DynamicFL's salience); the simulator keeps one per virtual device."""


@dataclass
class LocalOutcome:
    """What a procedure returns: the trained model plus what it measured."""

    model: ScalableNet
    num_samples: int
    losses: list[float]
    steps: int
    untouched: set[str] = field(default_factory=set)  # tensors that received no gradient (ScaleFL counts)
    extra: dict[str, Any] = field(default_factory=dict)


# (model, the board's data, the task's typed hyper-parameters, the device store, the task's generator); the third
# argument is the record the procedure registered (`params=`), a TrainParams subclass.
Procedure = Callable[[ScalableNet, ClientData, Any, DeviceStore, torch.Generator], LocalOutcome]
F = TypeVar("F", bound=Procedure)
_PROCEDURES: dict[str, Procedure] = {}
_BATCHABLE: set[str] = set()
_PARAMS: dict[str, type[TrainParams]] = {}


def register(
    name: str, *, batchable: bool = False, params: type[TrainParams] = TrainParams
) -> Callable[[F], F]:
    """Register a local procedure under `name`. `batchable`: the simulator's batched trainer
    (simulator/batched.py) reproduces it exactly, so same-spec clients may share one vmapped step.
    `params`: the typed record of the hyper-parameters its tasks carry (nestling.task_params), which the
    procedure receives as its third argument."""
    if not (isinstance(params, type) and issubclass(params, TrainParams)):
        raise ConfigError(
            f"local procedure '{name}': params must be a TrainParams record (nestling.task_params), got {params!r}"
        )

    def wrap(fn: F) -> F:
        if name in _PROCEDURES and _PROCEDURES[name] is not fn:
            raise ConfigError(f"local procedure '{name}' is registered twice")
        _PROCEDURES[name] = fn
        _PARAMS[name] = params
        if batchable:
            _BATCHABLE.add(name)
        return fn

    return wrap


def params_for(name: str) -> type[TrainParams]:
    """The hyper-parameter record procedure `name` accepts."""
    get_procedure(name)  # unknown names: the usual error
    return _PARAMS[name]


def check_hparams(procedure: str, hparams: dict[str, Any]) -> TrainParams:
    """A task's hyper-parameters as its procedure's typed record; ConfigError naming a bad key or value."""
    return params_for(procedure).from_hparams(hparams, procedure)


def snapshot_procedures() -> tuple[dict[str, Procedure], set[str], dict[str, type[TrainParams]]]:
    """The registry as it is now, for `restore_procedures` (tests and plugins that register for a while)."""
    return dict(_PROCEDURES), set(_BATCHABLE), dict(_PARAMS)


def restore_procedures(
    snapshot: tuple[dict[str, Procedure], set[str], dict[str, type[TrainParams]]],
) -> None:
    """Put the registry back exactly as `snapshot_procedures` saw it (added names gone, replaced ones back)."""
    procedures, batchable, params = snapshot
    _PROCEDURES.clear()
    _PROCEDURES.update(procedures)
    _BATCHABLE.clear()
    _BATCHABLE.update(batchable)
    _PARAMS.clear()
    _PARAMS.update(params)


register_procedure = register


def unregister_procedure(name: str) -> None:
    """Forget procedure `name` (tests and plugins that define one for a while)."""
    _PROCEDURES.pop(name, None)
    _PARAMS.pop(name, None)
    _BATCHABLE.discard(name)


def is_batchable(name: str) -> bool:
    """Whether clients running procedure `name` may be trained together by the batched trainer."""
    return name in _BATCHABLE


def get_procedure(name: str) -> Procedure:
    """The procedure registered as `name`; ConfigError listing the known ones."""
    try:
        return _PROCEDURES[name]
    except KeyError:
        raise ConfigError(
            f"unknown local procedure '{name}' (known: {', '.join(sorted(_PROCEDURES))})"
        ) from None


def known_procedures() -> list[str]:
    """Every registered procedure name, sorted."""
    return sorted(_PROCEDURES)
