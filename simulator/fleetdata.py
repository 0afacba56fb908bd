"""The simulated fleet's data: one dataset, partitioned per device, rebuilt identically in every worker."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from nestling.data import DatasetBundle, load_dataset, make_partition
from nestling.edge.procedures import ClientData


def device_id(index: int) -> str:
    return f"dev-{index:05d}"


def device_index(device: str) -> int:
    return int(device.rsplit("-", 1)[1])


@dataclass
class FleetData:
    bundle: DatasetBundle
    parts: list[np.ndarray]
    augment: str

    def client(self, device: str) -> ClientData:
        idx = self.parts[device_index(device)]
        return ClientData(self.bundle.train.x[idx], self.bundle.train.y[idx], self.augment)


def load_fleet_data(
    dataset: str,
    root: str | None,
    seed: int,
    partition: str,
    clients: int,
    partition_options: dict[str, Any],
    limit_train: int | None = None,
    limit_test: int | None = None,
    augment: bool | None = None,
) -> FleetData:
    """Deterministic in its arguments, so every worker process rebuilds exactly the same partition."""
    opts: dict[str, Any] = {}
    if limit_train is not None:
        opts["limit_train"] = limit_train
    if limit_test is not None:
        opts["limit_test"] = limit_test
    bundle = load_dataset(dataset, root, seed=seed, **opts)
    parts = make_partition(partition, bundle.train.y.numpy(), clients, seed, **partition_options)
    kind = bundle.augment if augment is None or augment else "none"
    return FleetData(bundle, parts, kind)


_LAST_LOADED: tuple[str, FleetData] | None = None


def shared_fleet_data(**kwargs: Any) -> FleetData:
    """`load_fleet_data`, kept for the last arguments: a worker's training data and its evaluation data (the
    test set, sBN calibration images) come from one load, so a worker holds one copy of the dataset, not two."""
    global _LAST_LOADED
    key = json.dumps(kwargs, sort_keys=True, default=str)
    if _LAST_LOADED is None or _LAST_LOADED[0] != key:
        _LAST_LOADED = (key, load_fleet_data(**kwargs))
    return _LAST_LOADED[1]


def client_provider(**kwargs: Any):
    """Factory used by worker processes: returns device id → ClientData."""
    return shared_fleet_data(**kwargs).client
