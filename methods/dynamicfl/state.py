"""What a DynamicFL board keeps between rounds: its structure ζ_i, salience history and trained branches.

`DynamicState` serialises to a flat dict of tensors plus JSON-able metadata (`to_record`), or to one
nested dict of tensors only (`to_store`, the metadata as UTF-8 bytes in a uint8 tensor) that fits a
DeviceStore, a simulator checkpoint and the agent's safetensors state file unchanged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

SCHEMA = 1


@dataclass
class DynamicState:
    """One board's DynamicFL state.

    round: the last round that updated it (-1: never trained). structure: site → branches of each
    conv the board trains as a DBB. local_salience: S^l, from the last epoch of that round; global_salience:
    S^g, from its first epoch (paper protocol). history: S^l of every round so far, oldest first, with
    `history_rounds` naming the rounds. branches: each DBB's non-original branch tensors (`sites.branch_state`),
    so the paper's REP(ω_g, ζ_i) continues from the branches the board trained. capacity: the last one used.
    """

    round: int = -1
    capacity: int = 0
    structure: dict[str, tuple[str, ...]] = field(default_factory=dict)
    local_salience: dict[str, float] = field(default_factory=dict)
    global_salience: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, float]] = field(default_factory=list)
    history_rounds: list[int] = field(default_factory=list)
    branches: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    @property
    def started(self) -> bool:
        return self.round >= 0

    def remember_local(self, round_index: int, salience: Mapping[str, float]) -> None:
        """Record this round's S^l as the current one and in the history."""
        self.local_salience = dict(salience)
        self.history.append(dict(salience))
        self.history_rounds.append(int(round_index))

    # -- serialisation ---------------------------------------------------------------------------
    def _site_names(self) -> list[str]:
        names: set[str] = set(self.local_salience) | set(self.global_salience) | set(self.structure)
        for entry in self.history:
            names |= set(entry)
        return sorted(names)

    def to_record(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, metadata): salience as float64 vectors over `metadata["sites"]` (NaN: not measured)."""
        names = self._site_names()

        def vector(values: Mapping[str, float]) -> torch.Tensor:
            return torch.tensor([float(values.get(n, math.nan)) for n in names], dtype=torch.float64)

        tensors: dict[str, torch.Tensor] = {
            "salience.local": vector(self.local_salience),
            "salience.global": vector(self.global_salience),
            "salience.history": torch.stack([vector(h) for h in self.history])
            if self.history
            else torch.zeros(0, len(names), dtype=torch.float64),
        }
        for site, state in self.branches.items():
            for key, value in state.items():
                tensors[f"branches.{site}/{key}"] = value.detach().to("cpu").contiguous()
        metadata = {
            "schema": SCHEMA,
            "round": self.round,
            "capacity": self.capacity,
            "sites": names,
            "structure": {site: list(branches) for site, branches in self.structure.items()},
            "history_rounds": list(self.history_rounds),
        }
        return tensors, metadata

    @classmethod
    def from_record(cls, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> DynamicState:
        if metadata.get("schema") != SCHEMA:
            raise ValueError(f"DynamicFL state schema {metadata.get('schema')!r} is not {SCHEMA}")
        try:
            names = [str(n) for n in metadata["sites"]]

            def values(vector: torch.Tensor) -> dict[str, float]:
                if vector.numel() != len(names):
                    raise ValueError(f"a salience vector has {vector.numel()} entries for {len(names)} sites")
                return {n: float(v) for n, v in zip(names, vector.tolist()) if not math.isnan(v)}

            history_tensor = tensors["salience.history"]
            branches: dict[str, dict[str, torch.Tensor]] = {}
            for key, value in tensors.items():
                if key.startswith("branches."):
                    site, _, inner = key[len("branches.") :].partition("/")
                    branches.setdefault(site, {})[inner] = value
            state = cls(
                round=int(metadata["round"]),
                capacity=int(metadata["capacity"]),
                structure={str(s): tuple(str(b) for b in bs) for s, bs in metadata["structure"].items()},
                local_salience=values(tensors["salience.local"]),
                global_salience=values(tensors["salience.global"]),
                history=[values(row) for row in history_tensor],
                history_rounds=[int(r) for r in metadata["history_rounds"]],
                branches=branches,
            )
        except KeyError as exc:
            raise ValueError(f"DynamicFL state record is missing {exc}") from None
        if len(state.history) != len(state.history_rounds):
            raise ValueError(
                f"{len(state.history)} salience history rows for {len(state.history_rounds)} rounds"
            )
        missing = sorted(set(state.branches) - set(state.structure))
        if missing:
            raise ValueError(f"stored branches for convs outside the structure: {missing}")
        return state

    def to_store(self) -> dict[str, Any]:
        """A nested dict of tensors only (DeviceStore-ready): {"meta": uint8 JSON, "tensors": {...}}."""
        tensors, metadata = self.to_record()
        encoded = torch.tensor(list(json.dumps(metadata, sort_keys=True).encode()), dtype=torch.uint8)
        return {"meta": encoded, "tensors": dict(tensors)}

    @classmethod
    def from_store(cls, store: Mapping[str, Any]) -> DynamicState:
        try:
            meta = store["meta"]
            tensors = store["tensors"]
        except KeyError as exc:
            raise ValueError(f"DynamicFL device store entry is missing {exc}") from None
        if not isinstance(meta, torch.Tensor) or meta.dtype != torch.uint8:
            raise ValueError("DynamicFL device store 'meta' must be a uint8 tensor of JSON")
        try:
            metadata = json.loads(bytes(meta.tolist()).decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"DynamicFL device store 'meta' is not JSON: {exc}") from None
        return cls.from_record(tensors, metadata)
