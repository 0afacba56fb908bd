"""Execution backends for client work in simulation: in-process, or a pool of single-thread workers."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Protocol

import torch

from edge.procedures import ClientData, DeviceStore
from edge.trainer import run_task
from nestling.messages import Result, Task

DataProvider = Callable[[str], ClientData]


class Backend(Protocol):
    """Trains a batch of tasks and returns their results in the same order."""

    def run(self, tasks: list[Task]) -> list[Result]: ...

    def close(self) -> None: ...


class InProcessBackend:
    """Trains tasks one after another in this process (GPU when the run's device is CUDA)."""

    def __init__(self, data_for: DataProvider, device: str = "cpu") -> None:
        self.data_for = data_for
        self.device = device
        self.stores: dict[str, DeviceStore] = {}

    def run(self, tasks: list[Task]) -> list[Result]:
        return [run_task(t, self.data_for(t.device_id), self.stores.setdefault(t.device_id, DeviceStore()), self.device)
                for t in tasks]

    def close(self) -> None:
        pass


# -- process pool ---------------------------------------------------------------------------------
_WORKER_DATA: DataProvider | None = None


def _worker_init(factory: Callable[..., DataProvider], factory_args: dict[str, Any]) -> None:
    """One torch thread per worker: oversubscribed threads collapse training on small boxes (DESIGN.md)."""
    global _WORKER_DATA
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1) if torch.get_num_interop_threads() != 1 else None
    _WORKER_DATA = factory(**factory_args)


def _worker_run(task: Task, store: DeviceStore) -> tuple[Result, DeviceStore]:
    assert _WORKER_DATA is not None
    result = run_task(task, _WORKER_DATA(task.device_id), store, "cpu")
    return result, store


class ProcessPoolBackend:
    """`workers` processes (default: one per core), each rebuilding the client data once from a factory.

    Per-device stores travel with the job and come back with the result, so any worker can serve any
    device and the pool stays balanced."""

    def __init__(self, factory: Callable[..., DataProvider], factory_args: dict[str, Any], workers: int) -> None:
        ctx = mp.get_context("spawn")
        self.pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init,
                                        initargs=(factory, factory_args))
        self.workers = workers
        self.stores: dict[str, DeviceStore] = {}

    def run(self, tasks: list[Task]) -> list[Result]:
        futures = [self.pool.submit(_worker_run, t, self.stores.get(t.device_id, DeviceStore())) for t in tasks]
        results = []
        for task, future in zip(tasks, futures):
            result, store = future.result()
            if store:
                self.stores[task.device_id] = store
            results.append(result)
        return results

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
