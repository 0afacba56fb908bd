"""One FedAvg workload through Nestling's simulator, Flower's simulation engine and plain PyTorch loops.

100 clients, 10 per round, ResNet-20 (Nestling's zoo model everywhere), 1 local epoch of 500
synthetic CIFAR-shaped samples, batch 32, SGD; one warm-up round, then 10 timed rounds; one torch
thread per worker and as many workers as cores everywhere. Each engine runs in its own subprocess,
one after another:
  loops, nestling-eager, flower      fp32, NCHW, one client at a time (Flower: the textbook loop)
  nestling-fast / flower-fast        fp32, channels-last; Nestling also compiles each client model
  nestling-bf16 / flower-bf16        channels-last, forward under bf16 autocast; Nestling times grouped
                                     vs one-by-one training of a round's clients and keeps the faster
Prints updates/s and samples/s of each (wall clock, and per CPU-second of the engine's process tree),
then one line `nestling_over_flower=… fp32_over_flower=… same_numerics_fp32=… same_numerics_bf16=…
loop_efficiency=…`:
  nestling_over_flower  Nestling's fast CPU path (bf16, channels-last, batching auto) ÷ Flower's textbook
                        fp32 loop. bf16 rounds the forward pass differently but trains to the same accuracy
                        on this workload: benchmarks/precision_parity.py (docs/benchmarks.md) measures it.
  fp32_over_flower      compiled channels-last fp32 Nestling ÷ Flower's textbook loop (same numerics)
  same_numerics_*       each Nestling engine ÷ Flower given the same precision and memory format
  loop_efficiency       eager Nestling without batching ÷ concurrent plain loops
Run: OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.vs_flower   (Flower: pip install nestling[bench])
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from nestling.edge.procedures import ClientData
from nestling.models.config import ModelConfig
from nestling.models.zoo import build
from nestling.spec import SubmodelSpec

SPEC = SubmodelSpec(ModelConfig("resnet20", num_classes=10, in_channels=3, image_size=32))
LR = 0.05


def client_samples(index: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Client `index`'s data, regenerated identically wherever needed (no download, no shared memory)."""
    generator = torch.Generator().manual_seed(10_000 + index)
    return torch.randn(samples, 3, 32, 32, generator=generator), torch.randint(
        0, 10, (samples,), generator=generator
    )


def synthetic_provider(samples: int) -> Any:
    """Nestling worker data factory: device id → that client's samples."""
    from nestling.simulator.fleetdata import device_index

    return lambda device: ClientData(*client_samples(device_index(device), samples))


@dataclass(frozen=True)
class Settings:
    """How one engine trains: Nestling's batching/compile, and the numerics every engine can be given."""

    batching: str = "off"
    compile: bool = False
    precision: str = "fp32"  # bf16: forward under CPU autocast (AMX / AVX-512 BF16)
    channels_last: bool = False


ENGINES = {
    "loops": Settings(),
    "nestling-eager": Settings(),
    "flower": Settings(),
    "nestling-fast": Settings(compile=True, channels_last=True),
    "flower-fast": Settings(channels_last=True),
    "nestling-bf16": Settings(batching="auto", precision="bf16", channels_last=True),
    "flower-bf16": Settings(precision="bf16", channels_last=True),
}


def plain_epoch(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    batch: int,
    seed: int,
    how: Settings = Settings(),
) -> None:
    """The textbook loop: shuffle, mini-batches, cross-entropy, SGD step (in the engine's numerics)."""
    if how.channels_last:
        model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model.train()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    for start in range(0, len(y), batch):
        idx = order[start : start + batch]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=how.precision == "bf16"):
            logits = model(x[idx])
        F.cross_entropy(logits.float(), y[idx]).backward()
        optimizer.step()


def tree_cpu() -> float:
    """CPU seconds used so far by this process and its live descendants (pool workers, Ray, actors)."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:  # exited between listing and reading
            continue
        total += times.user + times.system
    return total


def window(stamps: list[tuple[float, float]]) -> dict[str, float]:
    """Wall and CPU seconds between the end of the warm-up round and the end of the last round."""
    return {"seconds": stamps[-1][0] - stamps[0][0], "cpu": stamps[-1][1] - stamps[0][1]}


# -- engines (each runs in its own subprocess and prints one JSON line) --------------------------
def run_nestling(a: argparse.Namespace, how: Settings) -> dict[str, float]:
    from nestling.schedule import LrSchedule
    from nestling.server.clock import WallClock
    from nestling.server.coordinator import Coordinator, RoundPolicy
    from nestling.server.strategies import StrategyContext, create_strategy
    from nestling.server.strategies.base import DeviceInfo
    from nestling.simulator.backend import ProcessPoolBackend
    from nestling.simulator.batched import BatchPolicy
    from nestling.simulator.fleetdata import device_id
    from nestling.simulator.inprocess import InProcessTransport

    ctx = StrategyContext(
        arch="resnet20",
        num_classes=10,
        in_channels=3,
        image_size=32,
        num_clients=a.clients,
        total_rounds=a.rounds + 1,
        schedule=LrSchedule("constant", LR),
        local={
            "local_epochs": 1,
            "batch_size": a.batch,
            "momentum": 0.0,
            "weight_decay": 0.0,
            **({"precision": how.precision} if how.precision != "fp32" else {}),
            **({"channels_last": True} if how.channels_last else {}),
        },
    )
    strategy = create_strategy("fedavg", ctx)
    devices = [DeviceInfo(device_id(i), i, a.samples) for i in range(a.clients)]
    backend = ProcessPoolBackend(
        synthetic_provider,
        {"samples": a.samples},
        a.workers,
        BatchPolicy(how.batching, how.compile),
        sizes=lambda _: a.samples,
    )
    stamps: list[tuple[float, float]] = []
    policy = RoundPolicy(
        rounds=a.rounds + 1, fraction=a.per_round / a.clients, eval_every=0, checkpoint_every=0
    )
    coordinator = Coordinator(
        strategy,
        InProcessTransport(devices, backend),
        WallClock(),
        None,
        policy,
        None,
        on_round=lambda _: stamps.append((time.perf_counter(), tree_cpu())),
    )
    try:
        coordinator.run()
    finally:
        backend.close()
    return window(stamps)


def run_flower(a: argparse.Namespace, how: Settings) -> dict[str, float]:
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    client_app, server_app = ClientApp(), ServerApp()
    stamps: list[tuple[float, float]] = []

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        index = int(context.node_config["partition-id"])
        model = build(SPEC, init=False)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        plain_epoch(model, *client_samples(index, a.samples), a.batch, seed=index, how=how)
        content = RecordDict(
            {
                "arrays": ArrayRecord({k: v.contiguous() for k, v in model.state_dict().items()}),
                "metrics": MetricRecord({"num-examples": a.samples}),
            }
        )
        return Message(content=content, reply_to=msg)

    class TimedFedAvg(FedAvg):
        def aggregate_train(self, server_round: int, replies: Any) -> Any:
            aggregated = super().aggregate_train(server_round, replies)
            stamps.append((time.perf_counter(), tree_cpu()))
            return aggregated

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        torch.manual_seed(0)
        strategy = TimedFedAvg(
            fraction_train=a.per_round / a.clients,
            fraction_evaluate=0.0,
            min_train_nodes=a.per_round,
            min_available_nodes=a.clients,
        )
        strategy.start(
            grid=grid, initial_arrays=ArrayRecord(build(SPEC).state_dict()), num_rounds=a.rounds + 1
        )

    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=a.clients,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": a.workers},
        },
        overwrite=True,
    )
    return window(stamps)


def _loop_worker(rank: int, a: argparse.Namespace, barrier: Any, times: Any) -> None:
    torch.set_num_threads(1)
    weights = build(SPEC).state_dict()
    mine = [c for c in range(a.rounds * a.per_round) if c % a.workers == rank]
    model = build(SPEC, init=False)
    model.load_state_dict(weights)
    plain_epoch(model, *client_samples(0, a.samples), a.batch, seed=0)  # warm-up, untimed
    barrier.wait()
    start, cpu = time.perf_counter(), time.process_time()
    for client in mine:
        model = build(SPEC, init=False)
        model.load_state_dict(weights)
        plain_epoch(model, *client_samples(client, a.samples), a.batch, seed=client)
    times.put((start, time.perf_counter(), time.process_time() - cpu))


def run_loops(a: argparse.Namespace) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    barrier, times = ctx.Barrier(a.workers), ctx.Queue()
    procs = [ctx.Process(target=_loop_worker, args=(r, a, barrier, times)) for r in range(a.workers)]
    for p in procs:
        p.start()
    spans = [times.get() for _ in procs]
    for p in procs:
        p.join()
    return {
        "seconds": max(end for _, end, _ in spans) - min(start for start, _, _ in spans),
        "cpu": sum(cpu for _, _, cpu in spans),
    }


# -- orchestration -----------------------------------------------------------------------------
def engine(a: argparse.Namespace, name: str) -> dict[str, float] | str:
    """Run one engine in a fresh interpreter; its figures, or the reason it could not run."""
    cmd = [
        sys.executable,
        __file__,
        "--engine",
        name,
        *(f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k not in ("engine", "order")),
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return (done.stderr.strip().splitlines() or ["no output"])[-1]
    return json.loads(lines[-1])


def report(a: argparse.Namespace) -> None:
    """Run the engines one after another and print their rates, wall-clock and per CPU-second."""
    updates, samples = a.rounds * a.per_round, a.rounds * a.per_round * a.samples
    print(
        f"workload: {a.clients} clients, {a.per_round}/round, ResNet-20, {a.samples} samples x 1 epoch, "
        f"batch {a.batch}, {a.rounds} timed rounds after 1 warm-up, {a.workers} workers x 1 thread"
    )
    labels = {
        "loops": "plain PyTorch loops (1 per core)",
        "nestling-eager": "Nestling (no batching)",
        "flower": "Flower simulation (Ray), textbook loop",
        "nestling-fast": "Nestling (compiled, NHWC)",
        "flower-fast": "Flower, NHWC loop",
        "nestling-bf16": "Nestling (NHWC, bf16, batching auto)",
        "flower-bf16": "Flower, NHWC loop, bf16",
    }
    figures: dict[str, dict[str, float] | str] = {name: "not run" for name in labels}
    for name in a.order.split(","):
        label = labels[name]
        result = engine(a, name)
        figures[name] = result
        if isinstance(result, str):
            print(f"{label:<42} could not run: {result}", flush=True)
            continue
        # CPU-normalised: the rate had the engine had `workers` cores to itself (others share this box).
        print(
            f"{label:<42} {updates / result['seconds']:6.2f} updates/s "
            f"{samples / result['seconds']:6.1f} samples/s "
            f"({result['seconds']:.0f} s, load {os.getloadavg()[0]:.1f}) | per CPU: "
            f"{updates * a.workers / result['cpu']:6.2f} updates/s",
            flush=True,
        )

    def ratio(fast: str, slow: str, per_cpu: bool = False) -> str:
        def rate(name: str) -> float:
            result = figures[name]
            if isinstance(result, str):
                return math.nan
            return updates * a.workers / result["cpu"] if per_cpu else updates / result["seconds"]

        return f"{rate(fast) / rate(slow):.3f}"

    pairs = {
        "nestling_over_flower": ("nestling-bf16", "flower"),
        "fp32_over_flower": ("nestling-fast", "flower"),
        "same_numerics_fp32": ("nestling-fast", "flower-fast"),
        "same_numerics_bf16": ("nestling-bf16", "flower-bf16"),
        "loop_efficiency": ("nestling-eager", "loops"),
    }
    print("cpu_normalised: " + " ".join(f"{k}={ratio(*v, per_cpu=True)}" for k, v in pairs.items()))
    print(" ".join(f"{k}={ratio(*v)}" for k, v in pairs.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds (one warm-up round runs first)")
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--order", default=",".join(ENGINES), help="engines, in run order")
    parser.add_argument("--engine", choices=tuple(ENGINES))
    a = parser.parse_args()
    if a.engine is None:
        report(a)
        return
    torch.set_num_threads(1)
    how = ENGINES[a.engine]
    if a.engine == "loops":
        result = run_loops(a)
    elif a.engine.startswith("flower"):
        result = run_flower(a, how)
    else:
        result = run_nestling(a, how)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
