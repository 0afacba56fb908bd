"""SubmodelSpec: a JSON-serialisable, hashable description of one nested submodel (METHODS §1.1)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from nestling.errors import SpecError
from nestling.models.config import ModelConfig


@dataclass(frozen=True)
class SubmodelSpec:
    """One submodel of a ModelConfig's global model.

    width: channel ratio ρ of the residual stream and of every block (NeFL: ρ = √γ_W, see
      `width_from_param_fraction`). block_widths: optional per-block ratio of each block's hidden
      channels. blocks: indices of executed residual blocks (others are skipped: their residual
      branch is not run, a projection shortcut still is). depth: blocks from this index on are
      removed entirely (DepthFL / ScaleFL depth prefix); None keeps all. exits: exit heads kept;
      head: whether the final classifier is part of the submodel.
    """

    model: ModelConfig
    width: float = 1.0
    blocks: tuple[int, ...] | None = None
    depth: int | None = None
    exits: tuple[int, ...] = ()
    block_widths: tuple[float, ...] | None = None
    head: bool = True
    _id: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 < float(self.width) <= 1.0:
            raise SpecError(f"width must be in (0, 1], got {self.width}")
        object.__setattr__(self, "width", float(self.width))
        if self.blocks is not None:
            object.__setattr__(self, "blocks", tuple(sorted(set(int(b) for b in self.blocks))))
        object.__setattr__(self, "exits", tuple(sorted(set(int(e) for e in self.exits))))
        if self.block_widths is not None:
            widths = tuple(float(w) for w in self.block_widths)
            if any(not 0.0 < w <= 1.0 for w in widths):
                raise SpecError(f"block_widths must all be in (0, 1], got {widths}")
            object.__setattr__(self, "block_widths", widths)
        missing = [e for e in self.exits if e not in self.model.exit_points]
        if missing:
            raise SpecError(
                f"exits {missing} are not exit points of {self.model.arch} "
                f"(exit_points: {list(self.model.exit_points)})"
            )
        if self.depth is not None and self.depth < 1:
            raise SpecError(f"depth must keep at least one block, got {self.depth}")
        if self.depth is not None and self.head:
            raise SpecError("a depth-truncated submodel has no final head: set head=False and keep an exit")
        if not self.head and not self.exits:
            raise SpecError("a submodel without the final head must keep at least one exit")
        payload = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        object.__setattr__(self, "_id", hashlib.sha1(payload.encode()).hexdigest()[:12])

    def __hash__(self) -> int:
        return hash(self._id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SubmodelSpec) and other._id == self._id

    @property
    def id(self) -> str:
        """Stable id: the same spec gives the same id on every machine and in every run."""
        return self._id

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.to_dict(),
            "width": self.width,
            "blocks": None if self.blocks is None else list(self.blocks),
            "depth": self.depth,
            "exits": list(self.exits),
            "block_widths": None if self.block_widths is None else list(self.block_widths),
            "head": self.head,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SubmodelSpec:
        try:
            return cls(
                model=ModelConfig.from_dict(data["model"]),
                width=data.get("width", 1.0),
                blocks=None if data.get("blocks") is None else tuple(data["blocks"]),
                depth=data.get("depth"),
                exits=tuple(data.get("exits", ())),
                block_widths=None if data.get("block_widths") is None else tuple(data["block_widths"]),
                head=bool(data.get("head", True)),
            )
        except KeyError as exc:
            raise SpecError(f"submodel spec is missing the key {exc}") from None
        except TypeError as exc:
            raise SpecError(f"malformed submodel spec: {exc}") from None

    @classmethod
    def full(cls, model: ModelConfig) -> SubmodelSpec:
        """The global model itself: every block, every exit, the head."""
        return cls(model=model, exits=model.exit_points)


def width_from_param_fraction(gamma_w: float) -> float:
    """NeFL's γ_W is a parameter fraction; conv parameters scale with ρ², so ρ = √γ_W (METHODS §2.a.2)."""
    if not 0.0 < gamma_w <= 1.0:
        raise SpecError(f"parameter fraction must be in (0, 1], got {gamma_w}")
    return gamma_w**0.5
