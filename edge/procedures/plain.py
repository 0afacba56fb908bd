"""`sgd`: plain local SGD with cross-entropy on the deepest output (FedAvg, NeFL, HeteroFL, FeDepth r=1)."""

from __future__ import annotations

import torch

from nestling.edge.procedures.common import batches, cross_entropy, make_optimizer, outputs_list, step
from nestling.edge.procedures.registry import ClientData, DeviceStore, LocalOutcome, register
from nestling.models.net import ScalableNet
from nestling.task_params import TrainParams


@register("sgd", batchable=True)
def train_sgd(
    model: ScalableNet, data: ClientData, hp: TrainParams, store: DeviceStore, generator: torch.Generator
) -> LocalOutcome:
    """Plain local SGD on the deepest output."""
    params = list(model.parameters())
    optimizer = make_optimizer(params, hp)
    model.train()
    losses: list[float] = []
    for x, y in batches(data, hp, generator):
        logits = outputs_list(model(x))[-1]
        loss = cross_entropy(logits, y, hp)
        step(optimizer, loss, params, hp)
        losses.append(float(loss.detach()))
    return LocalOutcome(model, len(data), losses, len(losses))
