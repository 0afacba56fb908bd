"""Train clients that share one submodel spec together: one step over all of them.

Matches sequential `edge.trainer.run_task` to float tolerance for the plain `sgd` procedure: each
client keeps its own data order and augmentation (its own task generator), BatchNorm normalises with
each client's own batch statistics and updates each client's own running statistics, and SGD
(momentum, weight decay, gradient clipping) acts per client exactly as torch.optim.SGD does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import psutil
import torch
import torch.nn.functional as F
from torch.func import functional_call, vmap

from nestling.edge.execution import apply_memory_format, task_precision
from nestling.edge.procedures import ClientData, DeviceStore, is_batchable
from nestling.edge.procedures.common import batches, make_optimizer
from nestling.edge.trainer import run_task, task_generator, task_params
from nestling.errors import ConfigError
from nestling.messages import Result, Task
from nestling.models.net import ScalableNet
from nestling.models.zoo import build
from nestling.packed import pack
from nestling.simulator.grouped import GroupedClients, groupable, per_client_clip, per_client_cross_entropy
from nestling.spec import SubmodelSpec
from nestling.task_params import TrainParams

_HP_PER_CLIENT = ("seed", "label_set")


def batch_key(task: Task, num_samples: int) -> tuple[Any, ...] | None:
    """Tasks with equal keys can share one vmapped step (same spec, procedure, shapes, optimiser)."""
    if not is_batchable(task.procedure):
        return None
    shared = sorted((k, repr(v)) for k, v in task.hparams.items() if k not in _HP_PER_CLIENT)
    return (task.spec_id, task.procedure, task.round, num_samples, tuple(shared))


def _client_batches(
    params: list[TrainParams], datas: list[ClientData]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each client's own mini-batches in lock-step, stacked on a leading client dimension."""
    streams = [batches(data, hp, task_generator(hp)) for hp, data in zip(params, datas)]
    for step in zip(*streams):
        yield torch.stack([x for x, _ in step]), torch.stack([y for _, y in step])


def _class_mask(params: list[TrainParams], y: torch.Tensor, num_classes: int) -> torch.Tensor | None:
    """HeteroFL/FeDepth masked CE (edge.procedures.common.cross_entropy), one mask row per client."""
    if not params[0].masked_ce:
        return None
    rows = []
    for k, hp in enumerate(params):
        label_set = hp.label_set
        present = torch.zeros(num_classes, dtype=torch.bool, device=y.device)
        present[torch.as_tensor(label_set, device=y.device) if label_set is not None else y[k]] = True
        rows.append(present)
    return torch.stack(rows)


class _SgdState:
    """torch.optim.SGD's update, applied to K clients' stacked parameters at once."""

    def __init__(self, hp: TrainParams) -> None:
        self.lr = hp.lr
        self.momentum = hp.momentum
        self.weight_decay = hp.weight_decay
        self.clip = hp.grad_clip
        self.buffers: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, params: dict[str, torch.Tensor]) -> None:
        live = {name: (p, p.grad) for name, p in params.items() if p.grad is not None}
        if self.clip:
            # clip_grad_norm_ per client: the total 2-norm over that client's gradients.
            norms = torch.stack([g.flatten(1).norm(2, dim=1) for _, g in live.values()], dim=1)
            coef = (float(self.clip) / (norms.norm(2, dim=1) + 1e-6)).clamp(max=1.0)
            for p, g in live.values():
                g.mul_(coef.view(-1, *([1] * (p.dim() - 1))))
        for name, (p, g) in live.items():
            grad = g if self.weight_decay == 0 else g.add(p, alpha=self.weight_decay)
            if self.momentum != 0:
                buf = self.buffers.get(name)
                if buf is None:
                    buf = self.buffers[name] = grad.clone()
                else:
                    buf.mul_(self.momentum).add_(grad)
                grad = buf
            p.add_(grad, alpha=-self.lr)
            p.grad = None


def train_batched(
    tasks: list[Task], datas: list[ClientData], device: torch.device | str = "cpu", how: str = "auto"
) -> list[Result]:
    """Train same-key tasks (see `batch_key`) together; results in task order, as run_task makes them.

    how="auto": convolutional models train as one grouped network (simulator.grouped), others through
    vmap; "grouped" or "vmap" force one way (tests, benchmarks)."""
    if how not in ("auto", "grouped", "vmap"):
        raise ValueError(f"how must be auto, grouped or vmap, got {how!r}")
    started = time.perf_counter()
    params = [task_params(task) for task in tasks]  # as run_task builds them
    rss_before = psutil.Process().memory_info().rss
    spec = SubmodelSpec.from_dict(tasks[0].spec)
    template = build(spec, init=False)
    local = [ClientData(d.x.to(device), d.y.to(device), d.augment) for d in datas]
    if how == "grouped" or (how == "auto" and groupable(template)):
        states, curves = _train_grouped(template, tasks, params, local, device)
        how = "grouped"
    else:
        states, curves = _train_vmapped(spec, tasks, params, local, device)
        how = "vmap"
    seconds = (time.perf_counter() - started) / len(tasks)
    # run_task's CPU measure (RSS growth) taken over the whole group, each client charged an equal share.
    memory_share = max(0, psutil.Process().memory_info().rss - rss_before) // len(tasks)
    results = []
    for task, data, weights, curve in zip(tasks, datas, states, curves):
        metrics: dict[str, Any] = {
            "train_seconds": seconds,
            "loss_first": curve[0] if curve else None,
            "loss_last": curve[-1] if curve else None,
            "loss_mean": sum(curve) / len(curve) if curve else None,
            "steps": len(curve),
            "peak_memory_bytes": int(memory_share),
            "peak_memory_kind": "rss_growth_group_share",
            "untouched": [],
            "batched_with": len(tasks),
            "batched_how": how,
        }
        results.append(
            Result(
                round=task.round,
                device_id=task.device_id,
                task_id=task.task_id,
                spec_id=spec.id,
                weights=pack(weights),
                num_samples=len(data),
                metrics=metrics,
                model_id=task.model_id,
            )
        )
    return results


def _train_grouped(
    template: torch.nn.Module,
    tasks: list[Task],
    params_of: list[TrainParams],
    datas: list[ClientData],
    device: torch.device | str,
) -> tuple[list[dict[str, torch.Tensor]], list[list[float]]]:
    """One grouped network of all clients; torch.optim.SGD on it is each client's own SGD."""
    hp = params_of[0]  # what batch_key made equal across the group
    group = GroupedClients(cast(ScalableNet, template), [t.weights for t in tasks])
    net = group.net.to(device)
    apply_memory_format(net, hp)
    net.train()
    params = [p for p in net.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, hp)
    clip = hp.grad_clip
    num_classes = SubmodelSpec.from_dict(tasks[0].spec).model.num_classes
    losses: list[torch.Tensor] = []
    for x, y in _client_batches(params_of, datas):
        mask = _class_mask(params_of, y, num_classes)
        grouped_x = group.inputs(x)
        if hp.channels_last:
            grouped_x = grouped_x.contiguous(memory_format=torch.channels_last)
        with task_precision(hp, device):
            out = net(grouped_x)
            logits = out[-1] if isinstance(out, list) else out
            loss = per_client_cross_entropy(group.per_client(logits), y, mask)
        optimizer.zero_grad(set_to_none=True)
        loss.sum().backward()
        if clip:
            per_client_clip(params, group.k, float(clip))
        optimizer.step()
        losses.append(loss.detach())
    curves = torch.stack(losses, dim=1).tolist() if losses else [[] for _ in tasks]
    return group.client_states(), curves


def _train_vmapped(
    spec: SubmodelSpec,
    tasks: list[Task],
    params_of: list[TrainParams],
    datas: list[ClientData],
    device: torch.device | str,
) -> tuple[list[dict[str, torch.Tensor]], list[list[float]]]:
    """torch.func over stacked parameters: any architecture, slower than grouping on CPU."""
    hp = params_of[0]  # what batch_key made equal across the group
    template = build(spec, device="meta")
    template.train()
    names = list(template.state_dict().keys())
    param_names = {name for name, _ in template.named_parameters()}
    trainable = {name for name, p in template.named_parameters() if p.requires_grad}
    stacked = {name: torch.stack([t.weights[name] for t in tasks]).to(device) for name in names}
    params = {n: stacked[n].requires_grad_(n in trainable) for n in names if n in param_names}
    buffers = {n: stacked[n] for n in names if n not in param_names}
    num_classes = spec.model.num_classes

    def client_loss(
        p: dict[str, torch.Tensor],
        b: dict[str, torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        out = functional_call(template, (p, b), (x,))
        logits = out[-1] if isinstance(out, list) else out
        if mask is not None:
            logits = logits.masked_fill(~mask, 0.0)
        return F.cross_entropy(logits.float(), y)

    masked = hp.masked_ce
    per_client = vmap(client_loss, in_dims=(0, 0, 0, 0, 0 if masked else None))
    sgd = _SgdState(hp)
    losses: list[torch.Tensor] = []
    for x, y in _client_batches(params_of, datas):
        with task_precision(hp, device):
            loss = per_client(params, buffers, x, y, _class_mask(params_of, y, num_classes))
        loss.sum().backward()
        sgd.step(params)
        losses.append(loss.detach())
    curves = torch.stack(losses, dim=1).tolist() if losses else [[] for _ in tasks]
    states = [{n: stacked[n][k].detach().to("cpu").clone() for n in names} for k in range(len(tasks))]
    return states, curves


class BatchPolicy:
    """How a worker trains a round's tasks. Batching "off", "on", or "auto": time both ways per spec and
    keep whichever trained more samples per second (batching only when faster); the first group each way
    is a warm-up (compilation, allocator) and is not counted. `compile`: torch.compile each sequentially
    trained model (fused kernels; worth it for long runs with few specs)."""

    def __init__(self, mode: str = "off", compile: bool = False) -> None:
        if mode not in ("off", "on", "auto"):
            raise ConfigError(f"[run] batching must be off, on or auto, got '{mode}'")
        self.mode = mode
        self.compile = compile
        self.speed: dict[tuple[str, bool], float] = {}  # (spec id, batched) → samples per second
        self.warmed: set[tuple[str, bool]] = set()

    def batched(self, spec_id: str) -> bool:
        if self.mode != "auto":
            return self.mode == "on"
        for way in (False, True):
            if (spec_id, way) not in self.speed:
                return way
        return self.speed[(spec_id, True)] > self.speed[(spec_id, False)]

    def record(self, spec_id: str, batched: bool, samples: int, seconds: float) -> None:
        key = (spec_id, batched)
        if self.mode != "auto" or key in self.speed or seconds <= 0:
            return
        if key not in self.warmed:
            self.warmed.add(key)
            return
        self.speed[key] = samples / seconds


def compile_module(model: torch.nn.Module) -> None:
    """Compile in place; a fresh module of an already seen spec reuses the compiled graphs."""
    import torch._dynamo
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1  # one core per worker, also while compiling
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    model.compile()


def run_tasks(
    tasks: list[Task],
    data_for: Callable[[str], ClientData],
    stores: dict[str, DeviceStore],
    device: torch.device | str,
    policy: BatchPolicy,
) -> list[Result]:
    """Train tasks, grouping batchable ones per `policy`; results come back in task order."""
    datas = [data_for(t.device_id) for t in tasks]
    groups: dict[Any, list[int]] = {}
    for i, (task, data) in enumerate(zip(tasks, datas)):
        key = batch_key(task, len(data)) if policy.mode != "off" else None
        groups.setdefault(key if key is not None else ("single", i), []).append(i)
    results: list[Result | None] = [None] * len(tasks)
    for key, members in groups.items():
        group = [tasks[i] for i in members]
        use_batch = key[0] != "single" and len(members) > 1 and policy.batched(group[0].spec_id)
        started = time.perf_counter()
        if use_batch:
            trained = train_batched(group, [datas[i] for i in members], device)
        else:
            prepare = compile_module if policy.compile else None
            trained = [
                run_task(t, datas[i], stores.setdefault(t.device_id, DeviceStore()), device, prepare)
                for t, i in zip(group, members)
            ]
        if key[0] != "single" and len(members) > 1:
            samples = sum(len(datas[i]) for i in members)
            policy.record(group[0].spec_id, use_batch, samples, time.perf_counter() - started)
        for i, result in zip(members, trained):
            results[i] = result
    return [r for r in results if r is not None]
