"""Pieces every local procedure shares: optimiser, batching, augmentation, losses."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from nestling.data.augment import augment_batch
from nestling.edge.procedures.registry import ClientData
from nestling.task_params import TrainParams


def make_optimizer(params: list[nn.Parameter], hp: TrainParams) -> torch.optim.Optimizer:
    """SGD with the task's lr / momentum / weight decay (every method here uses SGD)."""
    return torch.optim.SGD(
        [p for p in params if p.requires_grad],
        lr=hp.lr,
        momentum=hp.momentum,
        weight_decay=hp.weight_decay,
    )


def batch_size_for(data: ClientData, hp: TrainParams) -> int:
    """The task's batch size, never more than the board's samples."""
    return max(1, min(hp.batch_size, len(data)))


def local_step_count(data: ClientData, hp: TrainParams) -> int:
    """Steps of one local run: `local_steps` when given, else `local_epochs` passes over the data."""
    if hp.local_steps is not None:
        return hp.local_steps
    return hp.local_epochs * max(1, -(-len(data) // batch_size_for(data, hp)))


def batches(
    data: ClientData, hp: TrainParams, generator: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Shuffled mini-batches for `local_epochs` epochs, or exactly `local_steps` steps when given."""
    n = len(data)
    batch = batch_size_for(data, hp)
    total = local_step_count(data, hp)
    done = 0
    while done < total:
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, batch):
            idx = order[start : start + batch]
            if len(idx) < 2 and n >= 2:  # a single-sample batch breaks BatchNorm's batch statistics
                continue
            x = data.x[idx]
            if data.augment != "none":
                x = augment_batch(x, data.augment, generator)
            yield x, data.y[idx]
            done += 1
            if done >= total:
                return


def cross_entropy(logits: torch.Tensor, y: torch.Tensor, hp: TrainParams) -> torch.Tensor:
    """CE, optionally label-masked: logits of classes outside the client's label set (HeteroFL) or,
    without one, outside the batch (FeDepth) are set to 0 — not −∞ (METHODS §7.1)."""
    if hp.masked_ce:
        present = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
        label_set = hp.label_set
        present[torch.as_tensor(label_set, device=logits.device) if label_set is not None else y] = True
        logits = logits.masked_fill(~present, 0.0)
    return F.cross_entropy(logits, y)


def step(
    optimizer: torch.optim.Optimizer, loss: torch.Tensor, params: list[nn.Parameter], hp: TrainParams
) -> None:
    """One optimiser step on `loss`: fresh gradients, the task's clipping, the update."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    clip_gradients(params, hp)
    optimizer.step()


def clip_gradients(params: list[nn.Parameter], hp: TrainParams) -> None:
    """Gradient-norm clipping at the task's `grad_clip` (HeteroFL's 1, METHODS §7.1) before every step."""
    if hp.grad_clip:
        nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], hp.grad_clip)


def log_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(z / T) over classes, in float32 whatever dtype the logits have.

    Distillation compares the softmaxes of nearly equal logits; under bf16 autocast the logits arrive in
    bfloat16 and softmax would stay there, so the KD gradient (student probabilities minus teacher
    probabilities) would be a difference of two numbers rounded to an 8-bit mantissa: 14-33 % off when
    the exits agree to ~0.02 in their logits (tests/edge/procedures/test_common.py). In fp32 a no-op."""
    z = logits.float()
    return F.log_softmax(z if temperature == 1.0 else z / temperature, dim=1)


def probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """softmax(z / T) over classes, in float32 (see `log_probs`)."""
    z = logits.float()
    return F.softmax(z if temperature == 1.0 else z / temperature, dim=1)


def outputs_list(out: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    return out if isinstance(out, list) else [out]
