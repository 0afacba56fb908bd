"""Run one Task on a board: build the assigned slice, train it with the named procedure, report a Result."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import psutil
import torch
from torch import nn

from nestling.edge.execution import apply_memory_format, task_precision
from nestling.edge.procedures import ClientData, DeviceStore, check_hparams, get_procedure
from nestling.messages import Result, Task
from nestling.models.zoo import build
from nestling.packed import pack
from nestling.spec import SubmodelSpec
from nestling.task_params import TrainParams


def task_params(task: Task) -> TrainParams:
    """The task's hyper-parameters as its procedure's typed record, at the task's round: built once, where the
    task arrives; a key the procedure does not know or a value of the wrong type is refused by name."""
    return dataclasses.replace(check_hparams(task.procedure, task.hparams), round=task.round)


def task_generator(params: TrainParams) -> torch.Generator:
    """Per-task RNG seeded from the task, so any backend or resume reproduces the same training."""
    generator = torch.Generator()
    generator.manual_seed(params.seed & 0x7FFF_FFFF_FFFF_FFFF)
    return generator


def run_task(
    task: Task,
    data: ClientData,
    store: DeviceStore | None = None,
    device: torch.device | str = "cpu",
    prepare: Callable[[nn.Module], None] | None = None,
) -> Result:
    """Train exactly the submodel the task names (never the full model) and package the trained slice.

    `prepare` may adapt the built model in place before training (the simulator compiles it)."""
    spec = SubmodelSpec.from_dict(task.spec)
    procedure = get_procedure(task.procedure)
    params = task_params(task)
    started = time.perf_counter()
    use_cuda = torch.device(device).type == "cuda"
    if use_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    rss_before = psutil.Process().memory_info().rss
    model = build(spec, init=False)
    model.load_state_dict(task.weights, strict=True)
    model.to(device)
    apply_memory_format(model, params)
    if prepare is not None:
        prepare(model)
    local = ClientData(data.x.to(device), data.y.to(device), data.augment)
    with task_precision(params, device):
        outcome = procedure(
            model, local, params, store if store is not None else DeviceStore(), task_generator(params)
        )
    trained = {k: v.detach().to("cpu").contiguous() for k, v in outcome.model.state_dict().items()}
    for key in outcome.untouched:
        trained.pop(key, None)
    seconds = time.perf_counter() - started
    peak = (
        torch.cuda.max_memory_allocated(device)
        if use_cuda
        else max(0, psutil.Process().memory_info().rss - rss_before)
    )
    metrics = {
        "train_seconds": seconds,
        "loss_first": outcome.losses[0] if outcome.losses else None,
        "loss_last": outcome.losses[-1] if outcome.losses else None,
        "loss_mean": sum(outcome.losses) / len(outcome.losses) if outcome.losses else None,
        "steps": outcome.steps,
        "peak_memory_bytes": int(peak),
        "peak_memory_kind": "cuda_allocator" if use_cuda else "rss_growth",
        "untouched": sorted(outcome.untouched),
        **{k: v for k, v in outcome.extra.items() if isinstance(v, (int, float, str, bool))},
    }
    return Result(
        round=task.round,
        device_id=task.device_id,
        task_id=task.task_id,
        spec_id=spec.id,
        weights=pack(trained),  # one buffer: what the server's update screen reads in one operation
        num_samples=outcome.num_samples,
        metrics=metrics,
        model_id=task.model_id,
    )
