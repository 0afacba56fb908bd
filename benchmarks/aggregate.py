"""NeFedAvg over 20 mixed-submodel ResNet-18 results vs one plain copy of the same bytes, measured side by side.

Prints the time of NeFedAvg (consistent tensors masked mean + per-submodel BN/step stores) divided by the
time of a `torch.cat` of all result tensors (the cost of touching every uploaded byte once).
Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/aggregate.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nestling.messages import Result, Task
from nestling.server.strategies import StrategyContext, create_strategy
from nestling.server.strategies.base import DeviceInfo


def main(clients: int = 20, repeats: int = 5) -> None:
    torch.set_num_threads(1)
    ctx = StrategyContext(
        arch="resnet18",
        num_classes=10,
        in_channels=3,
        image_size=32,
        num_clients=clients,
        total_rounds=10,
        seed=0,
    )
    strategy = create_strategy("nefl-wd", ctx)
    devices = [DeviceInfo(f"dev-{i:05d}", i, 100) for i in range(clients)]
    tasks = strategy.assign(0, devices)
    accepted: list[tuple[Task, Result]] = []
    for task in tasks.values():
        trained = {
            k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v for k, v in task.weights.items()
        }
        accepted.append((task, Result(0, task.device_id, task.task_id, task.spec_id, trained, 100)))
    nbytes = sum(t.numel() * t.element_size() for _, r in accepted for t in r.weights.values())
    flat = [t.reshape(-1) for _, r in accepted for t in r.weights.values() if t.is_floating_point()]
    counts = {}
    for task, _ in accepted:
        counts[task.spec_id] = counts.get(task.spec_id, 0) + 1

    def time_it(fn) -> float:
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    # The stricter baseline copies into a buffer allocated once, so page-faulting fresh memory is not counted.
    buffer = torch.empty(sum(t.numel() for t in flat))
    copy_s = time_it(lambda: torch.cat(flat, out=buffer))
    fresh_s = time_it(lambda: torch.cat(flat))
    aggregate_s = time_it(lambda: strategy.aggregate(0, accepted))
    print(
        f"{clients} ResNet-18 NeFL-WD results, {len(counts)} distinct submodels, {nbytes / 1e6:.1f} MB uploaded"
    )
    print(
        f"torch.cat into a preallocated buffer: {copy_s * 1e3:.1f} ms   torch.cat allocating: {fresh_s * 1e3:.1f} ms"
        f"   NeFedAvg: {aggregate_s * 1e3:.1f} ms"
    )
    print(
        f"nefedavg_over_copy={aggregate_s / copy_s:.2f} nefedavg_over_fresh_cat={aggregate_s / fresh_s:.2f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    main(args.clients, args.repeats)
