"""`fjord`: ordered dropout — a width p ≤ p_max sampled per mini-batch, optional p_max self-distillation (METHODS §7.2)."""

from __future__ import annotations

import torch

from nestling.edge.procedures.common import (
    batches,
    clip_gradients,
    cross_entropy,
    log_probs,
    make_optimizer,
    outputs_list,
    probs,
    step,
)
from nestling.edge.procedures.registry import ClientData, DeviceStore, LocalOutcome, register
from nestling.errors import ConfigError
from nestling.models.layers import set_active_width
from nestling.models.net import ScalableNet
from nestling.task_params import FjordParams


def fjord_kd_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the student's softmax against the detached teacher's (T = 1), batch mean, in float32
    whatever dtype the logits have (common.log_probs)."""
    return torch.sum(-probs(teacher.detach()) * log_probs(student), dim=1).mean()


def widths_up_to(p_max: float, levels: list[float]) -> list[float]:
    """The widths a client of tier p_max may sample (never above p_max)."""
    allowed = [p for p in levels if p <= p_max + 1e-9]
    if not allowed:
        raise ValueError(f"no FjORD width level ≤ p_max={p_max} in {levels}")
    return allowed


@register("fjord", params=FjordParams)
def train_fjord(
    model: ScalableNet, data: ClientData, hp: FjordParams, store: DeviceStore, generator: torch.Generator
) -> LocalOutcome:
    """Ordered dropout: one width ≤ p_max per mini-batch, optionally distilled from the widest allowed."""
    if hp.widths is None:
        raise ConfigError("task hyper-parameter 'widths' for procedure 'fjord' is missing: the width grid")
    allowed = widths_up_to(hp.p_max, hp.widths)
    params = list(model.parameters())
    optimizer = make_optimizer(params, hp)
    use_kd = hp.fjord_kd
    model.train()
    losses: list[float] = []
    sampled: list[float] = []
    for x, y in batches(data, hp, generator):
        p = allowed[int(torch.randint(len(allowed), (1,), generator=generator))]
        sampled.append(p)
        optimizer.zero_grad(set_to_none=True)
        if use_kd and p < allowed[-1]:
            # Teacher = the widest allowed width, trained by its own CE only.
            set_active_width(model, allowed[-1])
            teacher = outputs_list(model(x))[-1]
            cross_entropy(teacher, y, hp).backward()
            set_active_width(model, p)
            student = outputs_list(model(x))[-1]
            loss = fjord_kd_loss(student, teacher)
            loss.backward()
            clip_gradients(params, hp)  # the step holds both backward passes' gradients
            optimizer.step()
        else:
            set_active_width(model, p)
            loss = cross_entropy(outputs_list(model(x))[-1], y, hp)
            step(optimizer, loss, params, hp)
        losses.append(float(loss.detach()))
    set_active_width(model, None)
    return LocalOutcome(model, len(data), losses, len(losses), extra={"sampled_widths": sampled})
