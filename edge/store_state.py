"""Device stores as one flat tensor dict, so they can live in a safetensors file.

A store holds tensors, possibly nested in dicts with string keys (m-FeDepth's auxiliary state dicts,
FedDyn's h_k). Each leaf's key is the JSON list of the names leading to it, so device ids and store keys
may contain any character. Anything but tensors and string-keyed dicts is refused by name: silently
dropping state would make a resumed run differ from an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from nestling.edge.procedures.registry import DeviceStore
from nestling.errors import NestlingError

log = logging.getLogger("nestling.agent")


def stores_to_tensors(stores: dict[str, DeviceStore]) -> dict[str, torch.Tensor]:
    """Every non-empty store's leaves, keyed by [device, key, subkey, ...]."""
    flat: dict[str, torch.Tensor] = {}

    def walk(path: list[str], value: Any) -> None:
        if isinstance(value, torch.Tensor):
            flat[json.dumps(path)] = value.detach().to("cpu").contiguous()
        elif isinstance(value, dict):  # an empty dict comes back absent: procedures read with get/setdefault
            for key, inner in value.items():
                if not isinstance(key, str):
                    raise NestlingError(f"device store {path} has a non-string key {key!r}")
                walk([*path, key], inner)
        else:
            raise NestlingError(f"device store entry {path} is of type {type(value).__name__}, not a tensor")

    for device, store in stores.items():
        if store:
            walk([device], dict(store))
    return flat


def stores_from_tensors(flat: dict[str, torch.Tensor]) -> dict[str, DeviceStore]:
    """The stores `stores_to_tensors` flattened, nested exactly as they were."""
    stores: dict[str, DeviceStore] = {}
    for key, tensor in flat.items():
        try:
            path = json.loads(key)
        except json.JSONDecodeError:
            raise NestlingError(f"device store key {key!r} is not a JSON path") from None
        if not (isinstance(path, list) and len(path) >= 2 and all(isinstance(p, str) for p in path)):
            raise NestlingError(f"device store key {key!r} is not a [device, key, ...] path")
        node: dict[str, Any] = stores.setdefault(path[0], DeviceStore())
        for name in path[1:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = tensor
    return stores


def save_store_file(path: Path, store: DeviceStore, owner: str) -> None:
    """Write a board's store so that a power cut at any instant leaves the old file or the new one.
    `owner` (fleet/device) is recorded so a file copied to another board or fleet is not picked up."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(stores_to_tensors({owner: store}), str(tmp), metadata={"owner": owner})
    with tmp.open("rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load_store_file(path: Path, owner: str) -> DeviceStore:
    """The store `save_store_file` wrote for `owner`, or an empty one (with a warning saying why) when the
    file is absent, unreadable or another board's: a board must come up even when its old state cannot."""
    if not path.is_file():
        return DeviceStore()
    try:
        with safe_open(str(path), framework="pt") as fh:
            recorded = (fh.metadata() or {}).get("owner")
        if recorded != owner:
            log.warning(
                "device state %s belongs to %r, not %r: starting with empty state", path, recorded, owner
            )
            return DeviceStore()
        return stores_from_tensors(load_file(str(path))).get(owner, DeviceStore())
    except (SafetensorError, OSError, NestlingError) as exc:
        log.warning("device state %s is unreadable (%s): starting with empty state", path, exc)
        return DeviceStore()
