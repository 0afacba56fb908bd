"""Parity of an exported graph with its PyTorch reference: max absolute/relative error, top-1 agreement."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

Runner = Callable[[np.ndarray], list[np.ndarray]]


@dataclass(frozen=True)
class ParityReport:
    """Errors over every output and sample. rel = max|a − b| / max|b| (relative to the logits' scale:
    an element-wise ratio explodes on logits near zero and says nothing about predictions)."""

    inputs: str
    samples: int
    max_abs: float
    max_rel: float
    top1_agreement: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare(candidate: Sequence[np.ndarray], reference: Sequence[np.ndarray], inputs: str) -> ParityReport:
    if len(candidate) != len(reference):
        raise ValueError(f"{len(candidate)} outputs against {len(reference)} reference outputs")
    max_abs, scale, agree, total = 0.0, 0.0, 0, 0
    for a, b in zip(candidate, reference):
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a64.shape != b64.shape:
            raise ValueError(f"output shape {a64.shape} differs from the reference {b64.shape}")
        max_abs = max(max_abs, float(np.abs(a64 - b64).max(initial=0.0)))
        scale = max(scale, float(np.abs(b64).max(initial=0.0)))
        agree += int((a64.argmax(-1) == b64.argmax(-1)).sum())
        total += a64.shape[0]
    samples = int(reference[0].shape[0]) if reference else 0
    return ParityReport(
        inputs, samples, max_abs, max_abs / scale if scale > 0 else 0.0, agree / max(1, total)
    )


def batched(run: Runner, x: np.ndarray, batch_size: int = 256) -> list[np.ndarray]:
    """Run over `x` in chunks and concatenate each output."""
    chunks = [run(np.ascontiguousarray(x[i : i + batch_size])) for i in range(0, len(x), batch_size)]
    return [np.concatenate([c[k] for c in chunks]) for k in range(len(chunks[0]))]


def accuracy(run: Runner, x: np.ndarray, y: np.ndarray, batch_size: int = 256, output: int = 0) -> float:
    """Top-1 accuracy of one output of `run` on labelled data."""
    logits = batched(run, x, batch_size)[output]
    return float((logits.argmax(-1) == y).mean()) if len(y) else float("nan")
