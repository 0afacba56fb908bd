"""`nestling simulate`: one federated run in one process (plus worker processes), on the one coordinator."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from nestling.config import SimConfig
from nestling.schedule import LrSchedule
from server.clock import WallClock
from server.coordinator import Coordinator, RoundPolicy, RoundRecord
from server.evaluation import Evaluator
from server.strategies import StrategyContext, create_strategy
from server.strategies.base import DeviceInfo
from simulator.backend import Backend, InProcessBackend, ProcessPoolBackend
from simulator.fleetdata import client_provider, device_id, load_fleet_data
from simulator.inprocess import InProcessTransport
from simulator.report import plot_accuracy, read_metrics, summarise, write_summary


def partition_options(cfg: SimConfig) -> dict[str, Any]:
    scheme = cfg.data.partition
    if scheme in ("dirichlet", "balanced-dirichlet", "scalefl"):
        return {"alpha": cfg.data.alpha}
    if scheme == "shards":
        return {"classes_per_client": cfg.data.classes_per_client}
    return {}


def fleet_args(cfg: SimConfig) -> dict[str, Any]:
    return dict(dataset=cfg.data.dataset, root=cfg.data.root, seed=cfg.run.seed, partition=cfg.data.partition,
                clients=cfg.data.clients, partition_options=partition_options(cfg), limit_train=cfg.data.limit_train,
                limit_test=cfg.data.limit_test, augment=cfg.data.augment)


def local_hparams(cfg: SimConfig) -> dict[str, Any]:
    hp: dict[str, Any] = {"local_epochs": cfg.train.local_epochs, "batch_size": cfg.train.batch_size,
                          "momentum": cfg.train.momentum, "weight_decay": cfg.train.weight_decay}
    if cfg.train.local_steps is not None:
        hp["local_steps"] = cfg.train.local_steps
    if cfg.train.grad_clip is not None:
        hp["grad_clip"] = cfg.train.grad_clip
    return hp


def resolve_workers(cfg: SimConfig) -> int:
    if cfg.run.device.startswith("cuda"):
        return 1  # one process owns the GPU
    return cfg.run.workers or (os.cpu_count() or 1)


def build_backend(cfg: SimConfig, fleet_data_client, workers: int) -> Backend:
    if workers <= 1:
        return InProcessBackend(fleet_data_client, cfg.run.device)
    return ProcessPoolBackend(client_provider, fleet_args(cfg), workers)


def run_simulation(cfg: SimConfig, out_dir: Path, *, resume: bool = False,
                   on_round: Any = None) -> dict[str, Any]:
    """Run (or resume) a simulation; writes metrics.jsonl, checkpoints, summary.json and accuracy.png."""
    started = time.perf_counter()
    torch.set_num_threads(1)
    fleet = load_fleet_data(**fleet_args(cfg))
    bundle = fleet.bundle
    channels, size, _ = bundle.input_shape
    ctx = StrategyContext(
        arch=cfg.model.arch, num_classes=bundle.num_classes, in_channels=channels, image_size=size,
        num_clients=cfg.data.clients, total_rounds=cfg.run.rounds, seed=cfg.run.seed,
        schedule=LrSchedule(cfg.train.schedule, cfg.train.lr, cfg.train.gamma, tuple(cfg.train.milestones)),
        local=local_hparams(cfg), options=dict(cfg.method.options), model_extra=dict(cfg.model.extra))
    strategy = create_strategy(cfg.method.name, ctx)
    labels = bundle.train.y
    devices = [DeviceInfo(device_id(i), i, len(part), labels=tuple(sorted(set(labels[part].tolist()))))
               for i, part in enumerate(fleet.parts)]
    backend = build_backend(cfg, fleet.client, resolve_workers(cfg))
    transport = InProcessTransport(devices, backend)
    evaluator = Evaluator(bundle.test.x, bundle.test.y, batch_size=cfg.run.eval_batch, device=cfg.run.device,
                          calibration=bundle.train.x)
    policy = RoundPolicy(rounds=cfg.run.rounds, fraction=cfg.train.fraction, over_selection=cfg.run.over_selection,
                         quorum=cfg.run.quorum, deadline_s=cfg.run.deadline_s, eval_every=cfg.run.eval_every,
                         checkpoint_every=cfg.run.checkpoint_every, seed=cfg.run.seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    coordinator = Coordinator(strategy, transport, WallClock(), evaluator, policy, out_dir, on_round)
    if resume:
        coordinator.resume()
    elif (out_dir / "metrics.jsonl").exists():
        (out_dir / "metrics.jsonl").unlink()
    try:
        coordinator.run()
    finally:
        backend.close()
    records = read_metrics(out_dir)
    summary = summarise(records, cfg.to_dict(), time.perf_counter() - started)
    write_summary(out_dir, summary)
    plot_accuracy(out_dir, f"{cfg.method.name} · {cfg.model.arch} · {cfg.data.dataset}")
    return summary


__all__ = ["RoundRecord", "run_simulation"]
