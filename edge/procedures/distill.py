"""Multi-exit procedures: DepthFL mutual distillation (§7.3) and ScaleFL exit self-distillation (§6.a.5)."""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F

from nestling.edge.procedures.common import batches, log_probs, make_optimizer, outputs_list, probs, step
from nestling.edge.procedures.feddyn import FedDynTerm
from nestling.edge.procedures.registry import ClientData, DeviceStore, LocalOutcome, register
from nestling.models.net import ScalableNet
from nestling.task_params import DepthflParams, ScaleflParams


def depthfl_kd_weight(round_index: int, ramp_rounds: int = 300) -> float:
    """w_t = exp(−5·(1 − min(t, R)/R)²): sigmoid ramp-up of the consistency weight (METHODS §7.3)."""
    t = min(max(round_index, 0), ramp_rounds) / ramp_rounds
    return math.exp(-5.0 * (1.0 - t) ** 2)


def depthfl_loss(
    outputs: list[torch.Tensor], y: torch.Tensor, kd_weight: float, use_kd: bool = True
) -> torch.Tensor:
    """Σ_i CE(z_i, y) + (w/(d−1)) Σ_{j≠i} KL(softmax(z_j).detach() ‖ softmax(z_i)), T = 1, batch-mean KL."""
    d = len(outputs)
    loss = cast(torch.Tensor, sum(F.cross_entropy(z, y) for z in outputs))
    if use_kd and d > 1:
        students = [log_probs(z) for z in outputs]  # float32 under bf16 autocast too (common.log_probs)
        targets = [probs(z.detach()) for z in outputs]
        kd = students[0].new_zeros(())
        for i in range(d):
            for j in range(d):
                if i != j:
                    kd = kd + F.kl_div(students[i], targets[j] + 1e-7, reduction="batchmean")
        loss = loss + kd_weight / (d - 1) * kd
    return loss


def scalefl_exit_weights(num_outputs: int) -> list[float]:
    """Exit i weighted i / (J(J+1)/2): the weights sum to 1 (METHODS §6.a.5)."""
    total = num_outputs * (num_outputs + 1) / 2
    return [(i + 1) / total for i in range(num_outputs)]


def scalefl_loss(
    outputs: list[torch.Tensor], y: torch.Tensor, *, kd_active: bool, gamma: float, temperature: float
) -> torch.Tensor:
    """Code form of ScaleFL's loss: teacher = last exit, not detached, KLDiv 'mean' reduction."""
    weights = scalefl_exit_weights(len(outputs))
    teacher = outputs[-1]
    loss = weights[-1] * F.cross_entropy(teacher, y)
    for w, student in zip(weights[:-1], outputs[:-1]):
        term = F.cross_entropy(student, y)
        if kd_active and gamma > 0:
            t = temperature
            # KLDivLoss 'mean' of the reference: over batch *and* classes, written out because torch's
            # 'mean' is deprecated and will turn into 'batchmean'.
            kl = F.kl_div(log_probs(student, t), probs(teacher, t), reduction="sum") / student.numel()
            term = term + gamma * t * t * kl
        loss = loss + w * term
    return loss


@register("depthfl-kd", params=DepthflParams)
def train_depthfl(
    model: ScalableNet, data: ClientData, hp: DepthflParams, store: DeviceStore, generator: torch.Generator
) -> LocalOutcome:
    """Every exit's CE plus mutual distillation ramped over rounds, with FedDyn's term when α > 0."""
    params = list(model.parameters())
    optimizer = make_optimizer(params, hp)
    weight = depthfl_kd_weight(hp.round, hp.kd_ramp_rounds)
    use_kd = hp.kd
    alpha = hp.feddyn_alpha
    dyn = FedDynTerm(model, store, alpha) if alpha > 0 else None
    model.train()
    losses: list[float] = []
    for x, y in batches(data, hp, generator):
        loss = depthfl_loss(outputs_list(model(x)), y, weight, use_kd)
        losses.append(float(loss.detach()))
        if dyn is not None:
            loss = loss + dyn.penalty()
        step(optimizer, loss, params, hp)
    if dyn is not None:
        dyn.finish()
    return LocalOutcome(model, len(data), losses, len(losses), extra={"kd_weight": weight})


@register("scalefl-sd", params=ScaleflParams)
def train_scalefl(
    model: ScalableNet, data: ClientData, hp: ScaleflParams, store: DeviceStore, generator: torch.Generator
) -> LocalOutcome:
    """Weighted exit CE plus self-distillation from the last exit once its start round has passed."""
    params = list(model.parameters())
    optimizer = make_optimizer(params, hp)
    kd_active = hp.round > hp.kd_start_fraction * hp.total_rounds
    gamma, temperature = hp.kd_gamma, hp.kd_temperature
    model.train()
    losses: list[float] = []
    touched: set[str] = set()
    names = {id(p): n for n, p in model.named_parameters()}
    for x, y in batches(data, hp, generator):
        loss = scalefl_loss(
            outputs_list(model(x)), y, kd_active=kd_active, gamma=gamma, temperature=temperature
        )
        step(optimizer, loss, params, hp)
        touched.update(names[id(p)] for p in params if p.grad is not None)
        losses.append(float(loss.detach()))
    untouched = {n for n, _ in model.named_parameters()} - touched
    return LocalOutcome(
        model, len(data), losses, len(losses), untouched=untouched, extra={"kd_active": kd_active}
    )
