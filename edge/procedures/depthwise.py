"""`fedepth`: depth-wise sequential training within a memory budget, partial training and mutual distillation (METHODS §3.a).

Stage j trains its blocks plus the head (plus the stem in stage 0) for the full local budget; earlier
stages run frozen (without autograd unless the stem trains through them), bypassed input-side blocks do
not run at all, and a stage ending
before the last block reaches the head through a parameter-free link. With `models` > 1 (m-FeDepth)
the client also trains persistent auxiliary copies kept in its DeviceStore, each distilled from the
others; only the downloaded model is uploaded.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nestling.edge.procedures.common import (
    batches,
    cross_entropy,
    local_step_count,
    log_probs,
    make_optimizer,
    probs,
    step,
)
from nestling.edge.procedures.registry import ClientData, DeviceStore, LocalOutcome, register
from nestling.errors import ConfigError
from nestling.models.config import ModelConfig
from nestling.models.layers import SlimBatchNorm2d, SlimLayerNorm, SlimLinear
from nestling.models.net import ScalableNet
from nestling.models.zoo import build
from nestling.profiler.decompose import StagePlan
from nestling.profiler.memory import (
    SavedTensorMeter,
    gradient_bytes,
    model_tensors,
    optimizer_bytes,
    tensor_bytes,
)
from nestling.spec import SubmodelSpec
from nestling.task_params import FedepthParams

log = logging.getLogger("nestling.procedures")

AUX_KEY = "m-fedepth/aux{}"
# Called after every step when given: (stage, meter of that step's forward, optimizer, trainable parameters).
StepObserver = Callable[[int, SavedTensorMeter, torch.optim.Optimizer, list[nn.Parameter]], None]


def skip_link(z: torch.Tensor, stride: int, channels: int) -> torch.Tensor:
    """Parameter-free map to the head's input (§3.a.3): keep pixels 0, s, 2s, …; pad channels with zeros
    symmetrically (C_b → C_head). Token sequences (ViT) already have the head's shape."""
    if z.dim() != 4:
        return z
    if stride > 1:
        z = z[:, :, ::stride, ::stride]
    missing = channels - z.shape[1]
    if missing < 0:
        raise ConfigError(f"skip link: stage output has {z.shape[1]} channels, the head takes {channels}")
    left = missing // 2
    return F.pad(z, (0, 0, 0, 0, left, missing - left))


class StageRunner:
    """The forward pass and trainable set of each stage of one plan on one network."""

    def __init__(
        self, net: ScalableNet, plan: StagePlan, *, aux_heads: bool = False, stem_every_stage: bool = False
    ) -> None:
        head = net.head
        if head is None or getattr(head.fc, "in_features", None) != net.infos[-1].global_out:
            raise ConfigError("fedepth trains the full-width model with its final head")
        self.net, self.head, self.plan = net, head, plan
        self.aux_heads, self.stem_every_stage = aux_heads, stem_every_stage
        self.last = len(net.blocks) - 1

    def head_of(self, j: int) -> tuple[nn.Module, bool]:
        """The head stage j trains through, and whether it needs the skip link."""
        stage = self.plan.stages[j]
        end = stage[-1] if stage else None
        if end == self.last:
            return self.head, False
        if self.aux_heads and end is not None:
            return self.net.exits[str(end)], False
        return self.head, True

    def trains_stem(self, j: int) -> bool:
        return j == 0 or self.stem_every_stage

    def trainable(self, j: int) -> list[nn.Module]:
        modules = [self.net.blocks[b] for b in self.plan.stages[j]] + [self.head_of(j)[0]]
        return modules + ([self.net.stem] if self.trains_stem(j) else [])

    def link_stride(self, j: int) -> int:
        stage = self.plan.stages[j]
        after = self.net.infos[(stage[-1] + 1 if stage else 0) :]
        return math.prod(info.stride for info in after)

    def forward(self, x: torch.Tensor, j: int) -> torch.Tensor:
        stage = self.plan.stages[j]
        # Blocks before the stage hold nothing trainable. Without a trained stem they run without a graph
        # (nothing saved); with one, the stem's gradient must cross them: the bypassed prefix in stage 1
        # (§3.a.5, "the stem is still trained in stage 1") and the frozen earlier stages of a ViT (§3.a.9).
        with torch.set_grad_enabled(self.trains_stem(j)):
            z = self.net.stem(x)
            for b in range(stage[0] if stage else 0):
                if b in self.plan.bypass:
                    # Partial training (§3.a.5): the block does not run. DECISION: a block that changes the
                    # shape is crossed by the same parameter-free map as the skip link (identity otherwise).
                    info = self.net.infos[b]
                    z = skip_link(z, info.stride, info.global_out)
                else:
                    z = self.net.blocks[b](z)
        for b in stage:
            z = self.net.blocks[b](z)
        head, linked = self.head_of(j)
        if linked:
            z = skip_link(z, self.link_stride(j), self.net.infos[-1].global_out)
        logits: torch.Tensor = head(z)
        return logits

    def set_modes(self, j: int) -> None:
        """Frozen parts run in eval mode so running statistics (if any) stay frozen too."""
        self.net.train()
        trained = {id(m) for m in self.trainable(j)}
        for module in [self.net.stem, *self.net.blocks]:
            if id(module) not in trained:
                module.eval()


def mutual_loss(
    logits: list[torch.Tensor], y: torch.Tensor, hp: FedepthParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_m [CE_m + λ/(M−1) Σ_{m'≠m} KL(p^{m'}.detach() ‖ p^m)] (§3.a.7, batch-mean KL); also model 1's CE."""
    weight = hp.kd_weight
    first = cross_entropy(logits[0], y, hp)
    total = first
    for m, own in enumerate(logits):
        if m:
            total = total + cross_entropy(own, y, hp)
        if len(logits) > 1:
            log_p = log_probs(own)  # float32 under bf16 autocast too (common.log_probs)
            kl = sum(
                F.kl_div(log_p, probs(peer.detach()), reduction="batchmean")
                for k, peer in enumerate(logits)
                if k != m
            )
            total = total + weight / (len(logits) - 1) * kl
    return total, first


def stage_hparams(hp: FedepthParams, data: ClientData, stages: int) -> FedepthParams:
    """`full` (reference code): every stage gets the whole local budget; `split`: it is shared out."""
    if hp.stage_steps == "full":
        return hp
    return dataclasses.replace(hp, local_steps=max(1, local_step_count(data, hp) // stages))


def run_stages(
    models: list[ScalableNet],
    plan: StagePlan,
    data: ClientData,
    hp: FedepthParams,
    generator: torch.Generator,
    observe: StepObserver | None = None,
) -> list[float]:
    """Train every stage in order on all models together; returns model 1's loss per step."""
    runners = [
        StageRunner(net, plan, aux_heads=hp.variant == "aux", stem_every_stage=hp.stem_every_stage)
        for net in models
    ]
    learnable = {id(p): p.requires_grad for net in models for p in net.parameters()}
    per_stage = stage_hparams(hp, data, plan.num_stages)
    carried: dict[int, dict[str, torch.Tensor]] = {}
    losses: list[float] = []
    try:
        for j in range(plan.num_stages):
            params: list[nn.Parameter] = []
            for runner in runners:
                for p in runner.net.parameters():
                    p.requires_grad_(False)
                    p.grad = None  # earlier stages' gradients would only hold memory
                for module in runner.trainable(j):
                    params.extend(p for p in module.parameters() if learnable[id(p)])
                runner.set_modes(j)
            for p in params:
                p.requires_grad_(True)
            # A fresh optimizer over the trainable set only: frozen tensors get no decay and no momentum.
            optimizer = make_optimizer(params, per_stage)
            for p in params:
                if id(p) in carried:  # the head continues from the previous stage, momentum included
                    optimizer.state[p] = carried[id(p)]
            for x, y in batches(data, per_stage, generator):
                meter = (
                    SavedTensorMeter([t for net in models for t in model_tensors(net)]) if observe else None
                )
                with meter if meter is not None else contextlib.nullcontext():
                    loss, first = mutual_loss([r.forward(x, j) for r in runners], y, hp)
                step(optimizer, loss, params, hp)
                if observe is not None and meter is not None:
                    observe(j, meter, optimizer, params)
                losses.append(float(first.detach()))
            heads = {id(p) for r in runners for p in r.head.parameters()}
            carried = {id(p): state for p, state in optimizer.state.items() if id(p) in heads}
    finally:
        for net in models:
            for p in net.parameters():
                p.requires_grad_(learnable[id(p)])
            net.train()
    return losses


def measure_stage_peaks(
    models: list[ScalableNet],
    plan: StagePlan,
    data: ClientData,
    hp: FedepthParams,
    generator: torch.Generator,
) -> list[int]:
    """Train as `run_stages` does and return each stage's measured peak: a step's saved activations plus the
    weights and optimizer state of the trainable set and every gradient that exists in the models."""
    peaks = [0] * plan.num_stages

    def observe(
        j: int, meter: SavedTensorMeter, optimizer: torch.optim.Optimizer, params: list[nn.Parameter]
    ) -> None:
        held = (
            meter.total_bytes
            + tensor_bytes(params)
            + optimizer_bytes(optimizer)
            + sum(gradient_bytes(net.parameters()) for net in models)
        )
        peaks[j] = max(peaks[j], held)

    run_stages(models, plan, data, hp, generator, observe)
    return peaks


def initial_global_state(hp: FedepthParams) -> dict[str, torch.Tensor]:
    """The run's initial global model, rebuilt on the board from the config and seed the server built it from
    (server/strategies/base.py: `build(full spec)` under `torch.manual_seed(seed)`): no extra download."""
    info = hp.initial_model
    if not isinstance(info, dict) or "model" not in info or "seed" not in info:
        raise ConfigError(
            "m-FeDepth needs 'initial_model' ({'model': config, 'seed': int}) in the task to start its "
            f"auxiliary models from the initial global model, got {info!r}"
        )
    config = ModelConfig.from_dict(info["model"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(info["seed"]))
        return build(SubmodelSpec.full(config)).state_dict()


def fresh_auxiliary(model: ScalableNet, initial: dict[str, torch.Tensor]) -> ScalableNet:
    """m-FeDepth's auxiliary model (§3.a.7): a copy of the *initial* global model (not of this round's download,
    which would make the two models share everything the federation has learnt) with norm affines at (1, 0)
    and zero linear biases, shaped and placed like `model`."""
    own = model.state_dict()
    wrong = [k for k, v in own.items() if k not in initial or initial[k].shape != v.shape]
    if wrong:
        raise ConfigError(f"the initial model does not match the task's model at {wrong[:3]}")
    aux = copy.deepcopy(model)
    aux.load_state_dict({k: initial[k] for k in own}, strict=True)
    with torch.no_grad():
        for module in aux.modules():
            if isinstance(module, (SlimBatchNorm2d, SlimLayerNorm)) and module.weight is not None:
                module.weight.fill_(1.0)
                module.bias.zero_()
            elif isinstance(module, (SlimLinear, nn.Linear)) and module.bias is not None:
                module.bias.zero_()
    return aux


def load_auxiliaries(
    model: ScalableNet, store: DeviceStore, count: int, hp: FedepthParams
) -> list[ScalableNet]:
    """The client's persistent auxiliary models; missing ones (first participation) start afresh."""
    peers: list[ScalableNet] = []
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    initial: dict[str, torch.Tensor] | None = None
    for m in range(count):
        saved = store.get(AUX_KEY.format(m))
        if saved is not None and {k: v.shape for k, v in saved.items()} == shapes:
            peer = copy.deepcopy(model)
            peer.load_state_dict(saved, strict=True)
            peers.append(peer)
            continue
        if saved is not None:
            # Kept from another model (a new run, a restored state file): it cannot distil this one.
            log.warning(
                "auxiliary model %d in the device store does not fit the task's model: starting afresh", m
            )
        if initial is None:
            initial = initial_global_state(hp)
        peers.append(fresh_auxiliary(model, initial))
    return peers


@register("fedepth", params=FedepthParams)
def train_fedepth(
    model: ScalableNet, data: ClientData, hp: FedepthParams, store: DeviceStore, generator: torch.Generator
) -> LocalOutcome:
    """Depth-wise stages within the board's memory, with m-FeDepth's distilled auxiliary models."""
    if hp.plan is None:
        raise ConfigError("task hyper-parameter 'plan' for procedure 'fedepth' is missing: the stage plan")
    plan = StagePlan.from_dict(hp.plan)
    count = hp.models
    if count < 1:
        raise ConfigError(f"fedepth needs models >= 1, got {count}")
    peers = load_auxiliaries(model, store, count - 1, hp)
    losses = run_stages([model, *peers], plan, data, hp, generator)
    for m, peer in enumerate(peers):
        store[AUX_KEY.format(m)] = {k: v.detach().to("cpu").clone() for k, v in peer.state_dict().items()}
    untouched: set[str] = set()
    if not hp.aggregate_bypassed:
        untouched = {f"blocks.{b}.{k}" for b in plan.bypass for k in model.blocks[b].state_dict()}
    return LocalOutcome(
        model,
        len(data),
        losses,
        len(losses),
        untouched=untouched,
        extra={"stages": plan.num_stages, "bypassed": len(plan.bypass), "models": count},
    )
