"""`dynamicfl`: train a re-parameterised network, upload the plain one (METHODS §5).

The board receives the plain global model, expands up to `capacity` of its most salient K×K convolutions into
Diverse Branch Blocks (function-preserving, BN recalibrated on local batches), trains that richer network and
fuses it back exactly before the upload, so the server only ever sees plain weights. `protocol = "paper"` keeps
the structure ζ_i and salience between rounds in the device store (DYMM, DyRep's cut rule); `"released"` grows
afresh every round from epoch 0's salience. Capacity 0 is plain local SGD, bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from nestling.edge.procedures.common import batches, cross_entropy, make_optimizer, outputs_list
from nestling.edge.procedures.plain import train_sgd
from nestling.edge.procedures.registry import ClientData, DeviceStore, LocalOutcome, register
from nestling.methods.dynamicfl import (
    CutRule,
    DynamicState,
    ModulationPlan,
    find_sites,
    paper_round,
    released_round,
)
from nestling.models.net import ScalableNet
from nestling.task_params import DynamicflParams

STORE_KEY = "dynamicfl"
PROTOCOLS = ("paper", "released")


def calibration_batches(data: ClientData, hp: DynamicflParams) -> list[torch.Tensor]:
    """The first `recalibration_batches` local batches in data order (drawing no random numbers, so capacity 0
    trains exactly as plain SGD would)."""
    batch = max(1, min(hp.batch_size, len(data)))
    count = hp.recalibration_batches
    return [data.x[start : start + batch] for start in range(0, min(len(data), count * batch), batch)]


@register("dynamicfl", params=DynamicflParams)
def train_dynamicfl(
    model: ScalableNet, data: ClientData, hp: DynamicflParams, store: DeviceStore, generator: torch.Generator
) -> LocalOutcome:
    """Expand the most salient convolutions, train the richer network, fuse it back to plain weights."""
    capacity, protocol = hp.capacity, hp.protocol
    if protocol not in PROTOCOLS:
        raise ValueError(f"dynamicfl protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if capacity < 0:
        raise ValueError(f"dynamicfl capacity must be >= 0, got {capacity}")
    # Each "epoch" of the round drivers is one pass of the task's batching: E epochs, or one pass of local_steps.
    epochs = 1 if hp.local_steps is not None else max(1, hp.local_epochs)
    per_epoch = dataclasses.replace(hp, local_epochs=1)
    if capacity == 0:  # plain local SGD, bit for bit; a board's stored structure waits for a capacity again
        plain = train_sgd(model, data, hp, store, generator)
        plain.extra.update(_report(capacity, {}, ModulationPlan()))
        return plain
    losses: list[float] = []
    current: dict[
        str, Any
    ] = {}  # the optimiser, kept while the parameter set is unchanged (momentum survives)

    def train_epoch(net: nn.Module, after_backward: Callable[[], None]) -> None:
        params = list(net.parameters())
        ids = tuple(id(p) for p in params)
        if current.get("ids") != ids:  # the structure changed since the last epoch: new parameters
            current.update(ids=ids, optimizer=make_optimizer(params, hp))
        optimizer = current["optimizer"]
        net.train()
        clip = hp.grad_clip
        for x, y in batches(data, per_epoch, generator):
            loss = cross_entropy(outputs_list(net(x))[-1], y, hp)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            after_backward()
            if clip:
                nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], float(clip))
            optimizer.step()
            losses.append(float(loss.detach()))

    sites = find_sites(model, tuple(data.x.shape[1:]))
    calibration = calibration_batches(data, hp)
    inner_width = hp.inner_width
    if protocol == "paper":
        state = DynamicState.from_store(store[STORE_KEY]) if STORE_KEY in store else DynamicState()
        outcome = paper_round(
            model,
            sites,
            state,
            capacity,
            epochs,
            train_epoch,
            round_index=hp.round,
            calibration=calibration,
            generator=generator,
            inner_width=inner_width,
            local_weight=hp.local_weight,
            cut_rule=CutRule(hp.cut_spread, hp.cut_floor),
            keep_branches=hp.keep_branches,
        )
        store[STORE_KEY] = state.to_store()
    else:
        outcome = released_round(
            model,
            sites,
            capacity,
            epochs,
            train_epoch,
            calibration=calibration,
            generator=generator,
            inner_width=inner_width,
        )
    return LocalOutcome(
        model, len(data), losses, len(losses), extra=_report(capacity, outcome.structure, outcome.plan)
    )


def _report(capacity: int, structure: Mapping[str, Sequence[str]], plan: ModulationPlan) -> dict[str, Any]:
    """Scalars for the result's metrics (the trainer keeps only scalar extras): the server's round report."""
    return {
        "dynamicfl_capacity": capacity,
        "dynamicfl_expanded": len(structure),
        "dynamicfl_grown": len(plan.grow),
        "dynamicfl_cut": sum(len(v) for v in plan.cut.values()),
        "dynamicfl_collapsed": len(plan.collapse),
        "dynamicfl_structure": json.dumps(
            {site: sorted(branches) for site, branches in structure.items()},
            sort_keys=True,
            separators=(",", ":"),
        ),
    }
