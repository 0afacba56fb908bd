"""Ray backend: the pool backend's workers as Ray actors, so client training can spread over a cluster.

Each actor is a `WorkerState` (one torch thread, the fleet's data rebuilt once, its own batch policy);
jobs and per-device stores travel exactly as in the process pool, so a seed gives the same results on
either backend. Connects to a running cluster when RAY_ADDRESS is set, else starts a local Ray.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

from nestling.edge.procedures import DeviceStore
from nestling.errors import DependencyError
from nestling.messages import Result, Task
from nestling.simulator.backend import DataProvider, WorkerState, collect, split_jobs
from nestling.simulator.batched import BatchPolicy

RAY_HINT = "--backend ray needs ray: pip install nestling[ray]"


def import_ray() -> ModuleType:
    """The ray module, or a DependencyError saying how to install it."""
    try:
        return importlib.import_module("ray")
    except ImportError:
        raise DependencyError(RAY_HINT) from None


class RayBackend:
    """`workers` Ray actors with one CPU each; a round's jobs go to whichever actor is free."""

    def __init__(
        self,
        factory: Callable[..., DataProvider],
        factory_args: dict[str, Any],
        workers: int,
        policy: BatchPolicy | None = None,
        sizes: Callable[[str], int] | None = None,
    ) -> None:
        ray = import_ray()
        from ray.util import ActorPool

        self.ray = ray
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            local = {} if os.environ.get("RAY_ADDRESS") else {"num_cpus": workers}
            with warnings.catch_warnings():  # a tip about GPU env vars; actors here train on the CPU
                warnings.filterwarnings("ignore", category=FutureWarning, module="ray")
                ray.init(include_dashboard=False, log_to_driver=False, ignore_reinit_error=True, **local)
        actor = ray.remote(num_cpus=1)(WorkerState)
        self.policy = policy or BatchPolicy()
        self.actors = [actor.remote(factory, factory_args, self.policy) for _ in range(workers)]
        self.pool = ActorPool(self.actors)
        self.workers = workers
        self.sizes = sizes
        self.stores: dict[str, DeviceStore] = {}

    def run(self, tasks: list[Task]) -> list[Result]:
        jobs = split_jobs(tasks, self.workers, self.policy, self.sizes)
        payloads = [
            [(tasks[i], self.stores.get(tasks[i].device_id, DeviceStore())) for i in job] for job in jobs
        ]
        outputs = list(self.pool.map(lambda actor, job: actor.run.remote(job), payloads))
        return collect(tasks, jobs, outputs, self.stores)

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors = []
        if self.started_ray:
            self.ray.shutdown()
