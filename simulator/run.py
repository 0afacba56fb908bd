"""`nestling simulate`: one federated run in one process (plus worker processes), on the one coordinator."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from nestling.config import SimConfig
from nestling.config_io import write_config
from nestling.profiler.traces import load_traces
from nestling.run_folder import check_resumable, finished_summary, refuse_existing_run, start_new_run
from nestling.server.clock import WallClock
from nestling.server.coordinator import Coordinator, RoundRecord
from nestling.server.run_report import (
    add_method_results,
    plot_accuracy,
    read_metrics,
    summarise,
    write_summary,
)
from nestling.server.run_setup import round_policy, strategy_for_run
from nestling.server.strategies.base import DeviceInfo
from nestling.simulator.backend import (
    Backend,
    DataProvider,
    DeviceStoreSide,
    InProcessBackend,
    ProcessPoolBackend,
)
from nestling.simulator.batched import BatchPolicy
from nestling.simulator.fleetdata import FleetData, device_id, device_index, load_fleet_data
from nestling.simulator.inprocess import InProcessTransport, ResultObserver
from nestling.simulator.parallel_eval import evaluator_for, worker_evaluator
from nestling.simulator.replay import Replay, cycled_provider, fleet_size
from nestling.simulator.replay_report import write_replay_report
from nestling.simulator.server_time import server_time_for
from nestling.simulator.transport_time import transport_time_for


def partition_options(cfg: SimConfig) -> dict[str, Any]:
    scheme = cfg.data.partition
    if scheme in ("dirichlet", "balanced-dirichlet", "scalefl"):
        return {"alpha": cfg.data.alpha}
    if scheme == "shards":
        return {"classes_per_client": cfg.data.classes_per_client}
    return {}


def fleet_args(cfg: SimConfig) -> dict[str, Any]:
    return dict(
        dataset=cfg.data.dataset,
        root=cfg.data.root,
        seed=cfg.run.seed,
        partition=cfg.data.partition,
        clients=cfg.data.clients,
        partition_options=partition_options(cfg),
        limit_train=cfg.data.limit_train,
        limit_test=cfg.data.limit_test,
        augment=cfg.data.augment,
    )


def resolve_workers(cfg: SimConfig) -> int:
    if cfg.run.device.startswith("cuda"):
        return 1  # one process owns the GPU
    return cfg.run.workers or (os.cpu_count() or 1)


def build_backend(
    cfg: SimConfig,
    data_for: DataProvider,
    factory: Callable[..., DataProvider],
    factory_args: dict[str, Any],
    sizes: Callable[[str], int],
    workers: int,
) -> Backend:
    """[run] backend: auto (a pool when there is more than one worker), inprocess, pool or ray."""
    kind = cfg.run.backend
    if kind == "auto":
        kind = "pool" if workers > 1 else "inprocess"
    policy = BatchPolicy(cfg.run.batching, cfg.run.compile)
    if kind == "inprocess":
        return InProcessBackend(data_for, cfg.run.device, policy)
    if kind == "ray":
        from nestling.simulator.ray_backend import RayBackend

        return RayBackend(factory, factory_args, workers, policy, sizes)
    return ProcessPoolBackend(factory, factory_args, workers, policy, sizes)


def make_devices(fleet: FleetData, count: int) -> list[DeviceInfo]:
    """`count` devices; device i holds data partition i mod partitions (labels computed once per partition)."""
    labels = fleet.bundle.train.y
    per_part = [(len(part), tuple(sorted(set(labels[part].tolist())))) for part in fleet.parts]
    return [
        DeviceInfo(device_id(i), i, per_part[i % len(per_part)][0], labels=per_part[i % len(per_part)][1])
        for i in range(count)
    ]


def run_simulation(
    cfg: SimConfig,
    out_dir: Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    on_round: Any = None,
    tamper: Any = None,
    hello: Any = None,
    observers: Sequence[ResultObserver] = (),
) -> dict[str, Any]:
    """Run (or resume) a simulation; writes config.toml, metrics.jsonl, checkpoints, summary.json and
    accuracy.png. A folder holding a run is refused unless `resume` or `overwrite`; it is claimed only once
    the data, the strategy and the backend are ready, so a failed start leaves it as it was; a finished run
    resumed returns its summary and changes nothing.
    `observers`: each called with (task, result) for every result a simulated board trained, read-only (what
    the boards computed: simulator/reproduce_compute.py).
    `tamper(task, result) -> result | None` (None: refused at the wire) and `hello(devices) -> devices` (what
    the boards registered) stand in for bad boards (benchmarks/robustness.py)."""
    started = time.perf_counter()
    if resume:
        check_resumable(out_dir)
        finished = finished_summary(out_dir, cfg.run.rounds)
        if finished is not None:
            return finished
    else:
        refuse_existing_run(out_dir, overwrite=overwrite)
    torch.set_num_threads(1)
    traces = load_traces(cfg.run.traces) if cfg.run.traces else None
    count = fleet_size(cfg.data.clients, len(traces)) if traces else cfg.data.clients
    fleet = load_fleet_data(**fleet_args(cfg))
    bundle = fleet.bundle
    # The same strategy, deadline and training share as `nestling server` would plan this fleet with.
    strategy = strategy_for_run(
        cfg,
        num_classes=bundle.num_classes,
        input_shape=bundle.input_shape,
        num_clients=count,
        dataset=bundle.name,
    )
    devices = make_devices(fleet, count)
    partitions = len(fleet.parts)
    factory_args = {"partitions": partitions, **fleet_args(cfg)}
    backend = build_backend(
        cfg,
        lambda device: fleet.client(device_id(device_index(device) % partitions)),
        cycled_provider,
        factory_args,
        lambda device: devices[device_index(device)].num_samples,
        resolve_workers(cfg),
    )
    if not resume:
        start_new_run(out_dir, overwrite=overwrite)
        write_config(cfg, out_dir / "config.toml")
    replay = None
    if traces:
        plan = (strategy.full_spec, strategy.batch_size)  # replayed boards send their trace's profile
        replay = Replay(
            str(cfg.run.traces),
            traces,
            devices,
            backend,
            bundle.input_shape,
            out_dir,
            plan,
            server_time=server_time_for(cfg.run),
            transport_time=transport_time_for(cfg.run),
            schedule=(cfg.run.rounds, cfg.run.checkpoint_every),
            observers=observers,
            tamper=tamper,
        )
    registered = hello(list(devices)) if hello is not None else devices
    transport = (
        replay.transport
        if replay
        else InProcessTransport(registered, backend, tamper=tamper, observers=observers)
    )
    evaluation = {
        "batch_size": cfg.run.eval_batch,
        "calibration_samples": cfg.run.calibration_samples,
        "seed": cfg.run.seed,
    }
    runner = None
    if isinstance(backend, ProcessPoolBackend):  # the workers score a round's submodels side by side
        runner = backend.evaluation_runner(worker_evaluator, {"fleet": fleet_args(cfg), **evaluation})
    evaluator = evaluator_for(bundle, device=cfg.run.device, runner=runner, **evaluation)
    policy = round_policy(cfg)
    clock = replay.clock if replay else WallClock()
    hook = replay.after_round(on_round) if replay else on_round
    coordinator = Coordinator(
        strategy, transport, clock, evaluator, policy, out_dir, hook, side=DeviceStoreSide(backend.stores)
    )
    if resume:
        coordinator.resume()
    if replay:
        kept = read_metrics(out_dir)
        replay.start(coordinator.start_round if resume else None, kept[-1]["virtual_time"] if kept else 0.0)
    try:
        coordinator.run()
    finally:
        backend.close()
    records = read_metrics(out_dir)
    summary = summarise(records, cfg.to_dict(), time.perf_counter() - started)
    title = f"{cfg.method.name} · {cfg.model.arch} · {cfg.data.dataset}"
    if replay:
        summary["replay"] = replay.summary()
        summary["replay"]["report"] = str(
            write_replay_report(out_dir, title, summary["replay"]["device_classes"])
        )
    summary["quarantined"] = coordinator.quarantine_log
    boards = replay.fleet.devices if replay else devices  # replayed boards carry their trace's class
    add_method_results(summary, strategy, boards, coordinator.last_eval, cfg.run.rounds - 1, out_dir)
    summary["aggregate_seconds"] = coordinator.aggregate_seconds
    write_summary(out_dir, summary)
    plot_accuracy(out_dir, title)
    return summary


__all__ = ["RoundRecord", "run_simulation"]
