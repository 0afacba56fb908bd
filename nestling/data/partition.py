"""Seeded client partitions of a dataset (METHODS §1.4): which sample indices each client holds."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from nestling.data.dirichlet import dirichlet_balance_trick, dirichlet_balanced, scalefl_chunks
from nestling.data.partition_checks import as_labels, check_alpha, check_clients
from nestling.errors import ConfigError, DataError


def iid(n_samples: int, num_clients: int, seed: int) -> list[np.ndarray]:
    """N equal random shards without replacement (NeFL `cifar_iid`); the n mod N leftovers stay unassigned."""
    check_clients(num_clients, n_samples)
    order = np.random.default_rng(seed).permutation(n_samples)
    per_client = n_samples // num_clients
    return [order[i * per_client : (i + 1) * per_client] for i in range(num_clients)]


def shards(labels: Any, num_clients: int, classes_per_client: int, seed: int) -> list[np.ndarray]:
    """Pathological β(Λ) split: every client holds exactly Λ distinct classes.

    Each client takes the Λ classes least used so far (random tie-break), so classes are shared by
    ⌊NΛ/K⌋ or ⌈NΛ/K⌉ clients and pairings vary; each class's samples are then cut into equal shards among
    its holders. If N·Λ < K some classes have no holder and stay unassigned; a class smaller than its
    holder count leaves some holders without it.
    """
    label_array = as_labels(labels)
    check_clients(num_clients, len(label_array))
    classes = np.unique(label_array)
    if not isinstance(classes_per_client, (int, np.integer)) or not 1 <= classes_per_client <= len(classes):
        raise ConfigError(
            f"[partition] classes_per_client must be an integer in 1..{len(classes)}, got {classes_per_client!r}"
        )
    rng = np.random.default_rng(seed)
    usage = np.zeros(len(classes), dtype=np.int64)
    holders: list[list[int]] = [[] for _ in classes]
    for client in range(num_clients):
        picked = np.argsort(usage + rng.random(len(classes)), kind="stable")[:classes_per_client]
        usage[picked] += 1
        for class_pos in picked:
            holders[class_pos].append(client)
    pieces: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for class_pos, cls in enumerate(classes):
        if not holders[class_pos]:
            continue
        members = rng.permutation(np.flatnonzero(label_array == cls))
        for client, shard in zip(holders[class_pos], np.array_split(members, len(holders[class_pos]))):
            pieces[client].append(shard)
    return [rng.permutation(np.concatenate(p)) if p else np.empty(0, np.int64) for p in pieces]


def unbalanced(n_samples: int, num_clients: int, seed: int, sigma: float = 1.0) -> list[np.ndarray]:
    """IID labels, lognormal(0, σ) client sizes; every sample is assigned and every client gets at least one."""
    check_clients(num_clients, n_samples)
    if not np.isfinite(sigma) or sigma < 0:
        raise ConfigError(f"[partition] sigma must be a finite number >= 0, got {sigma!r}")
    rng = np.random.default_rng(seed)
    weights = rng.lognormal(0.0, sigma, size=num_clients)
    exact = weights / weights.sum() * (n_samples - num_clients)
    sizes = np.floor(exact).astype(np.int64)
    shortfall = n_samples - num_clients - int(sizes.sum())
    sizes[np.argsort(-(exact - sizes), kind="stable")[:shortfall]] += 1  # largest remainders
    sizes += 1
    return np.split(rng.permutation(n_samples), np.cumsum(sizes)[:-1])


def match_label_distribution(
    reference_parts: list[np.ndarray], reference_labels: Any, labels: Any, seed: int
) -> list[np.ndarray]:
    """Split another set (validation/test) so each client's class mix follows its reference partition.

    ScaleFL's "local" accuracy evaluates every client on held-out data drawn like its training data:
    class c's samples go to clients in proportion to how many of class c each one trains on.
    """
    ref = as_labels(reference_labels)
    target = as_labels(labels)
    num_classes = int(max(ref.max(), target.max())) + 1
    counts = partition_summary(reference_parts, ref, num_classes)
    rng = np.random.default_rng(seed)
    pieces: list[list[np.ndarray]] = [[] for _ in reference_parts]
    for cls in range(num_classes):
        column = counts[:, cls]
        if column.sum() == 0:
            continue
        members = rng.permutation(np.flatnonzero(target == cls))
        cuts = (np.cumsum(column / column.sum()) * len(members)).astype(np.int64)[:-1]
        for client, share in enumerate(np.split(members, cuts)):
            pieces[client].append(share)
    return [rng.permutation(np.concatenate(p)) if p else np.empty(0, np.int64) for p in pieces]


def partition_summary(parts: list[np.ndarray], labels: Any, num_classes: int) -> np.ndarray:
    """Counts per client and class, shape (clients, classes): the table to print or plot a partition."""
    label_array = as_labels(labels)
    if label_array.size and label_array.max() >= num_classes:
        raise DataError(f"labels reach {int(label_array.max())} but num_classes is {num_classes}")
    summary = np.zeros((len(parts), num_classes), dtype=np.int64)
    for client, indices in enumerate(parts):
        summary[client] = np.bincount(label_array[indices], minlength=num_classes)
    return summary


def mean_label_entropy(summary: np.ndarray) -> float:
    """Mean over clients of the label-histogram entropy in nats: log K for IID, 0 for one class each."""
    totals = summary.sum(axis=1, keepdims=True)
    shares = summary[totals[:, 0] > 0] / totals[totals[:, 0] > 0]
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(shares > 0, -shares * np.log(shares), 0.0)
    return float(terms.sum(axis=1).mean()) if len(terms) else 0.0


def _iid_from_labels(labels: Any, num_clients: int, seed: int) -> list[np.ndarray]:
    return iid(len(as_labels(labels)), num_clients, seed)


def _unbalanced_from_labels(labels: Any, num_clients: int, seed: int, sigma: float = 1.0) -> list[np.ndarray]:
    return unbalanced(len(as_labels(labels)), num_clients, seed, sigma=sigma)


def _shards_by_keyword(
    labels: Any, num_clients: int, seed: int, classes_per_client: int = 2
) -> list[np.ndarray]:
    return shards(labels, num_clients, classes_per_client, seed)


def _dirichlet_trick(
    labels: Any, num_clients: int, seed: int, alpha: float = 0.5, min_size: int = 10
) -> list[np.ndarray]:
    return dirichlet_balance_trick(labels, num_clients, alpha, seed, min_size=min_size)


def _dirichlet_exact(labels: Any, num_clients: int, seed: int, alpha: float = 0.5) -> list[np.ndarray]:
    return dirichlet_balanced(labels, num_clients, alpha, seed)


def _scalefl(
    labels: Any, num_clients: int, seed: int, alpha: float = 1.0, group: int = 10, min_size: int = 10
) -> list[np.ndarray]:
    return scalefl_chunks(labels, num_clients, alpha, seed, group=group, min_size=min_size)


# Defaults: α=0.5 is NeFL's non-IID setting; α=1 ScaleFL's non-IID one; Λ=2 the usual pathological split.
_SCHEMES: dict[str, Callable[..., list[np.ndarray]]] = {
    "iid": _iid_from_labels,
    "dirichlet": _dirichlet_trick,
    "balanced-dirichlet": _dirichlet_exact,
    "shards": _shards_by_keyword,
    "unbalanced": _unbalanced_from_labels,
    "scalefl": _scalefl,
}
KNOWN_SCHEMES = tuple(_SCHEMES)


def make_partition(scheme: str, labels: Any, num_clients: int, seed: int, **kw: Any) -> list[np.ndarray]:
    """Partition by scheme name (the config's `[data] partition`), with that scheme's own keywords."""
    if scheme not in _SCHEMES:
        raise ConfigError(f"[partition] unknown scheme {scheme!r} (known: {', '.join(KNOWN_SCHEMES)})")
    builder = _SCHEMES[scheme]
    accepted = [
        p for p in inspect.signature(builder).parameters if p not in ("labels", "num_clients", "seed")
    ]
    unknown = sorted(set(kw) - set(accepted))
    if unknown:
        raise ConfigError(
            f"[partition] {scheme} does not take {', '.join(unknown)} (accepted: {', '.join(accepted) or 'none'})"
        )
    if "alpha" in kw:
        check_alpha(kw["alpha"])
    return builder(labels, num_clients, seed, **kw)
