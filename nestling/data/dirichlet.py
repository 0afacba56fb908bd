"""Dirichlet label-skew partitions (METHODS §1.4): the balance trick, exact-size balanced, and ScaleFL chunks."""

from __future__ import annotations

from typing import Any

import numpy as np

from nestling.data.partition_checks import as_labels, check_alpha, check_clients
from nestling.errors import ConfigError

MAX_REDRAWS = 1000  # balance-trick redraws before declaring min_size unreachable
WEIGHT_FLOOR = (
    1e-12  # Dirichlet shares of tiny α underflow to 0; a floor lets a client fill up once its classes run out
)


def _check_min_size(min_size: Any, n_samples: int, num_clients: int) -> None:
    if isinstance(min_size, bool) or not isinstance(min_size, (int, np.integer)) or min_size < 0:
        raise ConfigError(f"[partition] min_size must be an integer >= 0, got {min_size!r}")
    if min_size * num_clients > n_samples:
        raise ConfigError(
            f"[partition] min_size {min_size} x {num_clients} clients exceeds the {n_samples} samples available"
        )


def _balance_trick_positions(
    labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator, min_size: int
) -> list[np.ndarray]:
    """METHODS §1.4 "Balanced-trick": per class p ~ Dir(α·1_N), zero clients already at |D|/N, renormalise,
    cut the shuffled class by cumulative shares; redraw everything until each client has >= min_size."""
    cap = len(labels) / num_clients
    members_by_class = [np.flatnonzero(labels == cls) for cls in np.unique(labels)]
    concentration = np.full(num_clients, float(alpha))
    for _ in range(MAX_REDRAWS):
        pieces: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for members in members_by_class:
            shuffled = rng.permutation(members)
            shares = rng.dirichlet(concentration) * (sizes < cap)
            total = shares.sum()
            shares = shares / total if total > 0 else np.full(num_clients, 1.0 / num_clients)
            cuts = (np.cumsum(shares) * len(shuffled)).astype(np.int64)[:-1]
            for client, piece in enumerate(np.split(shuffled, cuts)):
                pieces[client].append(piece)
                sizes[client] += len(piece)
        if sizes.min() >= min_size:
            return [rng.permutation(np.concatenate(p)) for p in pieces]
    raise ConfigError(
        f"[partition] no Dirichlet(alpha={alpha}) draw in {MAX_REDRAWS} gave all {num_clients} clients "
        f">= {min_size} of {len(labels)} samples; raise alpha or lower min_size"
    )


def dirichlet_balance_trick(
    labels: Any, num_clients: int, alpha: float, seed: int, min_size: int = 10
) -> list[np.ndarray]:
    """Label-skewed split with the balance trick (NeFL `noniiddir`, FeDepth `dir`); min_size 10 as in NeFL."""
    label_array = as_labels(labels)
    check_clients(num_clients, len(label_array))
    check_alpha(alpha)
    _check_min_size(min_size, len(label_array), num_clients)
    return _balance_trick_positions(label_array, num_clients, alpha, np.random.default_rng(seed), min_size)


def dirichlet_balanced(labels: Any, num_clients: int, alpha: float, seed: int) -> list[np.ndarray]:
    """METHODS §1.4 "Balanced Dirichlet" (FeDepth `balanced-dir`): every client gets exactly ⌊|D|/N⌋ samples.

    Client by client: π_i ~ Dir(α·1_K), each unassigned sample of class c weighs π_i[c], and ⌊|D|/N⌋ are
    drawn without replacement in proportion to weight (Efraimidis–Spirakis keys u^(1/w), top-m), then removed.
    """
    label_array = as_labels(labels)
    check_clients(num_clients, len(label_array))
    check_alpha(alpha)
    rng = np.random.default_rng(seed)
    num_classes = int(label_array.max()) + 1
    per_client = len(label_array) // num_clients
    available = np.ones(len(label_array), dtype=bool)
    parts = []
    for _ in range(num_clients):
        preference = np.maximum(rng.dirichlet(np.full(num_classes, float(alpha))), WEIGHT_FLOOR)
        candidates = np.flatnonzero(available)
        weights = preference[label_array[candidates]]
        log_keys = np.log1p(-rng.random(len(candidates))) / weights  # log(u)/w with u in (0, 1]
        chosen = candidates[np.argpartition(-log_keys, per_client - 1)[:per_client]]
        available[chosen] = False
        parts.append(rng.permutation(chosen))
    return parts


def scalefl_chunks(
    labels: Any, num_clients: int, alpha: float, seed: int, group: int = 10, min_size: int = 10
) -> list[np.ndarray]:
    """METHODS §1.4 ScaleFL (FedDF-style): shuffle, cut one contiguous chunk per group of `group` clients
    (sized by the group's share of clients), then the balance-trick Dirichlet(α) within each chunk."""
    label_array = as_labels(labels)
    check_clients(num_clients, len(label_array))
    check_alpha(alpha)
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 1:
        raise ConfigError(f"[partition] group must be a positive integer, got {group!r}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(label_array))
    group_sizes = [min(group, num_clients - start) for start in range(0, num_clients, group)]
    bounds = np.round(np.cumsum([0, *group_sizes]) / num_clients * len(label_array)).astype(np.int64)
    parts: list[np.ndarray] = []
    for clients_here, lo, hi in zip(group_sizes, bounds[:-1], bounds[1:]):
        chunk = order[lo:hi]
        _check_min_size(min_size, len(chunk), clients_here)
        local = _balance_trick_positions(label_array[chunk], clients_here, alpha, rng, min_size)
        parts.extend(chunk[positions] for positions in local)
    return parts
