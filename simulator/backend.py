"""Execution backends for client work in simulation: in-process, or a pool of single-thread workers."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any, Protocol

import torch

from nestling.edge.procedures import ClientData, DeviceStore
from nestling.edge.store_state import stores_from_tensors, stores_to_tensors
from nestling.eval_target import EvalTarget
from nestling.messages import Result, Task
from nestling.plugins import load_plugins
from nestling.profiler.speed import samples_trained
from nestling.server.evaluation import EvalResult, Evaluator, TargetRunner
from nestling.simulator.batched import BatchPolicy, batch_key, run_tasks
from nestling.simulator.packing import PackedState, pack_state

DataProvider = Callable[[str], ClientData]
Job = list[tuple[Task, DeviceStore]]


class Backend(Protocol):
    """Trains a batch of tasks and returns their results in the same order; keeps each device's store."""

    stores: dict[str, DeviceStore]

    def run(self, tasks: list[Task]) -> list[Result]: ...

    def close(self) -> None: ...


class InProcessBackend:
    """Trains tasks in this process (GPU when the run's device is CUDA), batched or compiled per `policy`."""

    def __init__(
        self, data_for: DataProvider, device: str = "cpu", policy: BatchPolicy | None = None
    ) -> None:
        self.data_for = data_for
        self.device = device
        self.policy = policy or BatchPolicy()
        self.stores: dict[str, DeviceStore] = {}

    def run(self, tasks: list[Task]) -> list[Result]:
        return run_tasks(tasks, self.data_for, self.stores, self.device, self.policy)

    def close(self) -> None:
        pass


class DeviceStoreSide:
    """A backend's per-device stores as checkpoint side state (coordinator.SideState)."""

    name = "device_stores"

    def __init__(self, stores: dict[str, DeviceStore]) -> None:
        self.stores = stores

    def snapshot(self) -> dict[str, torch.Tensor]:
        return stores_to_tensors(self.stores)

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        self.stores.clear()
        self.stores.update(stores_from_tensors(tensors))


def single_thread() -> None:
    """One torch thread per worker: oversubscribed threads collapse training on small boxes (DESIGN.md)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if torch.get_num_interop_threads() != 1:
        with contextlib.suppress(RuntimeError):  # already fixed once work ran in this process
            torch.set_num_interop_threads(1)


def task_cost(task: Task, num_samples: int) -> float:
    """Relative cost of a task for load balancing: weights trained × samples drawn (proportional to
    training FLOPs within a model family, which is all a balance between workers needs)."""
    return float(sum(w.numel() for w in task.weights.values())) * samples_trained(task.hparams, num_samples)


def balanced_jobs(costs: list[float], workers: int) -> list[list[int]]:
    """Longest-processing-time-first partition into at most `workers` jobs of near-equal total cost."""
    loads = [0.0] * min(workers, len(costs))
    jobs: list[list[int]] = [[] for _ in loads]
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        least = loads.index(min(loads))
        jobs[least].append(i)
        loads[least] += costs[i]
    return [sorted(job) for job in jobs if job]


def split_jobs(
    tasks: list[Task], workers: int, policy: BatchPolicy, sizes: Callable[[str], int] | None = None
) -> list[list[int]]:
    """Task indices per job. With known data sizes, one job per worker balanced by predicted cost: a
    worker then trains its whole share without waiting for the parent to feed it task by task (on a
    2-core box those hand-offs cost ~5 % of a round). When batching, each same-spec group is cut into
    at most `workers` near-equal chunks so every worker trains a share of the group together."""
    if sizes is None:
        return [[i] for i in range(len(tasks))]
    if policy.mode == "off":
        return balanced_jobs([task_cost(t, sizes(t.device_id)) for t in tasks], workers)
    groups: dict[Any, list[int]] = {}
    for i, task in enumerate(tasks):
        key = batch_key(task, sizes(task.device_id))
        groups.setdefault(key if key is not None else ("single", i), []).append(i)
    jobs: list[list[int]] = []
    for members in groups.values():
        parts = min(workers, len(members))
        jobs.extend(members[p::parts] for p in range(parts))
    return jobs


class WorkerState:
    """What one worker process holds: the fleet's data (rebuilt once from a factory) and its batch policy."""

    def __init__(
        self, factory: Callable[..., DataProvider], factory_args: dict[str, Any], policy: BatchPolicy
    ) -> None:
        single_thread()
        self.data_for = factory(**factory_args)
        self.policy = policy
        self._evaluator: tuple[str, Evaluator] | None = None

    def evaluator(self, factory: Callable[..., Evaluator], args: dict[str, Any]) -> Evaluator:
        """The evaluator `factory(**args)` builds, made once per worker (it holds the test set)."""
        key = f"{factory.__module__}.{factory.__qualname__}:{json.dumps(args, sort_keys=True, default=str)}"
        if self._evaluator is None or self._evaluator[0] != key:
            self._evaluator = (key, factory(**args))
        return self._evaluator[1]

    def run(self, job: Job) -> list[tuple[Result, DeviceStore]]:
        stores = {task.device_id: store for task, store in job}
        results = run_tasks([task for task, _ in job], self.data_for, stores, "cpu", self.policy)
        return [(result, stores[task.device_id]) for (task, _), result in zip(job, results)]


_WORKER: WorkerState | None = None
PackedJob = list[tuple[Task, PackedState, DeviceStore]]
PackedOutput = list[tuple[Result, PackedState, DeviceStore]]


def _pack_job(job: Job) -> PackedJob:
    return [(replace(task, weights={}), pack_state(task.weights), store) for task, store in job]


def _pack_output(output: list[tuple[Result, DeviceStore]]) -> PackedOutput:
    return [(replace(result, weights={}), pack_state(result.weights), store) for result, store in output]


def _unpack_output(output: PackedOutput) -> list[tuple[Result, DeviceStore]]:
    return [(replace(result, weights=packed.unpack()), store) for result, packed, store in output]


def exit_with_parent(poll_seconds: float = 1.0) -> threading.Thread:
    """Start a daemon thread that ends this process once its parent is gone.

    A pool worker busy with a round's job does not notice that `nestling simulate` was killed until the job
    ends, which can be minutes of both cores spent on results nobody will read (seen after stopping a
    reproduction with SIGTERM). Polling the parent pid works for SIGKILL too, on every platform."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        os._exit(1)

    thread = threading.Thread(target=watch, name="exit-with-parent", daemon=True)
    thread.start()
    return thread


def _worker_init(
    factory: Callable[..., DataProvider], factory_args: dict[str, Any], policy: BatchPolicy
) -> None:
    global _WORKER
    exit_with_parent()
    load_plugins()  # the parent's $NESTLING_PLUGINS: procedures a plugin registered run here too
    _WORKER = WorkerState(factory, factory_args, policy)


def _worker_run(job: PackedJob) -> PackedOutput:
    assert _WORKER is not None
    tasks = [(replace(task, weights=packed.unpack()), store) for task, packed, store in job]
    return _pack_output(_WORKER.run(tasks))


def _worker_evaluate(
    factory: Callable[..., Evaluator], args: dict[str, Any], target: EvalTarget, state: PackedState
) -> EvalResult:
    assert _WORKER is not None
    return _WORKER.evaluator(factory, args).evaluate(replace(target, state=state.unpack()))


class ProcessPoolBackend:
    """`workers` processes (default: one per core), each rebuilding the client data once from a factory.

    Per-device stores travel with the job and come back with the result, so any worker can serve any
    device and the pool stays balanced."""

    def __init__(
        self,
        factory: Callable[..., DataProvider],
        factory_args: dict[str, Any],
        workers: int,
        policy: BatchPolicy | None = None,
        sizes: Callable[[str], int] | None = None,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.policy = policy or BatchPolicy()
        self.pool = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=ctx,
            initializer=_worker_init,
            initargs=(factory, factory_args, self.policy),
        )
        self.workers = workers
        self.sizes = sizes
        self.stores: dict[str, DeviceStore] = {}

    def run(self, tasks: list[Task]) -> list[Result]:
        jobs = split_jobs(tasks, self.workers, self.policy, self.sizes)
        futures = [
            self.pool.submit(
                _worker_run,
                _pack_job([(tasks[i], self.stores.get(tasks[i].device_id, DeviceStore())) for i in job]),
            )
            for job in jobs
        ]
        return collect(tasks, jobs, [_unpack_output(f.result()) for f in futures], self.stores)

    def evaluation_runner(self, factory: Callable[..., Evaluator], args: dict[str, Any]) -> TargetRunner:
        """Score targets on the workers, one job each, largest first so the last to finish is a small one;
        `factory(**args)` must build in a worker the evaluator the coordinator would use."""

        def run(targets: list[EvalTarget]) -> list[EvalResult]:
            sizes = [sum(t.numel() for t in target.state.values()) for target in targets]
            order = sorted(range(len(targets)), key=lambda i: -sizes[i])
            futures = {
                i: self.pool.submit(
                    _worker_evaluate,
                    factory,
                    args,
                    replace(targets[i], state={}),
                    pack_state(targets[i].state),
                )
                for i in order
            }
            return [futures[i].result() for i in range(len(targets))]

        return run

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def collect(
    tasks: list[Task],
    jobs: list[list[int]],
    outputs: list[list[tuple[Result, DeviceStore]]],
    stores: dict[str, DeviceStore],
) -> list[Result]:
    """Results back in task order; non-empty device stores kept for the device's next task."""
    results: list[Result | None] = [None] * len(tasks)
    for job, output in zip(jobs, outputs):
        for i, (result, store) in zip(job, output):
            if store:
                stores[tasks[i].device_id] = store
            results[i] = result
    return [r for r in results if r is not None]
