"""The board's procedure state ([device] state_file): loaded at start, saved after every task.

DynamicFL's salience, FedDyn's h_k and the like survive a restart only through this file; it is
recorded as this fleet's and device's, so a file copied to another board is not picked up.
"""

from __future__ import annotations

import logging
from pathlib import Path

from nestling.edge.procedures import DeviceStore
from nestling.edge.store_state import load_store_file, save_store_file

log = logging.getLogger("nestling.agent")


class AgentStateFile:
    """Where (if anywhere) this board keeps its DeviceStore between runs."""

    def __init__(self, path: Path | None, fleet: str, device_id: str) -> None:
        self.path = path
        self.owner = f"{fleet}/{device_id}"

    def load(self) -> DeviceStore:
        return load_store_file(self.path, self.owner) if self.path else DeviceStore()

    def save(self, store: DeviceStore) -> None:
        """Persist the store after a task; a full disk costs the state, never the result."""
        if self.path is None or not store:
            return
        try:
            save_store_file(self.path, store, self.owner)
        except OSError as exc:
            log.error("could not save device state to %s: %s", self.path, exc)
