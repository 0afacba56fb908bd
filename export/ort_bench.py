"""Latency of ONNX Runtime and PyTorch eager measured side by side in one run (p50/p90 per batch size).

The runners are timed in interleaved rounds, so load from other processes on a shared machine falls
on all of them alike instead of on whichever happened to run second; both frameworks get the same
thread count.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from nestling.export.parity import Runner


@dataclass(frozen=True)
class Latency:
    p50_ms: float
    p90_ms: float
    mean_ms: float
    runs: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def ort_session(path: Path, threads: int = 1) -> ort.InferenceSession:
    """A CPU session with full graph optimisation and a fixed thread count."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def ort_runner(session: ort.InferenceSession) -> Runner:
    name = session.get_inputs()[0].name
    return lambda x: list(session.run(None, {name: x}))


def torch_runner(model: nn.Module) -> Runner:
    """Eager PyTorch on numpy input; the model returns a tensor, a list or a tuple of tensors."""

    def run(x: np.ndarray) -> list[np.ndarray]:
        with torch.inference_mode():
            out = model(torch.from_numpy(x))
        return [t.numpy() for t in (out if isinstance(out, (list, tuple)) else [out])]

    return run


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def measure(
    runners: dict[str, Callable[[np.ndarray], Any]],
    x: np.ndarray,
    *,
    rounds: int = 5,
    per_round: int = 20,
    warmup: int = 5,
) -> dict[str, Latency]:
    """Time each runner on `x`, `rounds` × `per_round` single calls, interleaving runners round by round."""
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for run in runners.values():
        for _ in range(warmup):
            run(x)
    for _ in range(rounds):
        for name, run in runners.items():
            for _ in range(per_round):
                start = time.perf_counter()
                run(x)
                samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: _stats(values) for name, values in samples.items()}


def _stats(values: list[float]) -> Latency:
    data = np.asarray(values)
    return Latency(
        float(np.percentile(data, 50)), float(np.percentile(data, 90)), float(data.mean()), len(data)
    )


def latency_table(
    runners: dict[str, Callable[[np.ndarray], Any]],
    input_shape: tuple[int, int, int],
    *,
    batches: tuple[int, ...] = (1, 32),
    threads: int = 1,
    rounds: int = 5,
    per_round: int = 20,
    seed: int = 0,
) -> dict[str, Any]:
    """{"threads", "batch_1": {runner: Latency, ...}, ...} plus each runner's ratio to the first.

    The first runner is the baseline (PyTorch eager), so "speedup" > 1 means faster than it.
    """
    rng = np.random.default_rng(seed)
    table: dict[str, Any] = {"threads": threads}
    baseline = next(iter(runners))
    with torch_threads(threads):
        for batch in batches:
            x = rng.standard_normal((batch, *input_shape), dtype=np.float32)
            # Large batches take longer per call: fewer calls keep the run short without starving p90.
            scale = max(1, batch // 8)
            stats = measure(runners, x, rounds=rounds, per_round=max(3, per_round // scale))
            row: dict[str, Any] = {name: s.to_dict() for name, s in stats.items()}
            row["speedup_p50"] = {
                name: stats[baseline].p50_ms / s.p50_ms for name, s in stats.items() if name != baseline
            }
            table[f"batch_{batch}"] = row
    return table
