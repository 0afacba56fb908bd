"""DynamicFL (METHODS §5): every board trains the plain global model, re-parameterised on the board.

The server side is FedAvg over plain weights: a board with capacity c expands up to c of its most salient K×K
convs into Diverse Branch Blocks, trains them and fuses them back before the upload
(nestling.edge.procedures.dynamicfl). What the server decides is each board's capacity: from the memory budget
it registered (the expansion's priced training memory must fit beside the plain model's), else from the
`capacities` option in equal contiguous tiers by client index (the released code's 1:1:1 `device_ratio`).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

from nestling.errors import ConfigError
from nestling.messages import Result, Task
from nestling.methods.dynamicfl import BRANCHES, ConvSite, affordable_capacity, find_sites
from nestling.models.zoo import build
from nestling.profiler.estimator import training_memory
from nestling.profiler.planner import device_memory_budget
from nestling.server.strategies.base import DeviceInfo, EvalTarget
from nestling.server.strategies.options import MethodOptions
from nestling.server.strategies.registry import register_strategy
from nestling.server.strategies.submodel import SubmodelStrategy
from nestling.spec import SubmodelSpec

PROTOCOLS = ("paper", "released")


@dataclass(frozen=True)
class DynamicFLOptions(MethodOptions):
    protocol: str = "paper"  # "paper": structure kept per board (DYMM + DyRep cuts); "released": stateless
    capacities: tuple[int, ...] = (
        0,
        1,
        2,
    )  # capacity tiers by client index when a board registered no budget
    max_capacity: int | None = None  # cap on a budget-derived capacity (None: every expandable conv)
    local_weight: float = 0.5  # S = w·S^l + (1 − w)·S^g (AMBIG-15)
    cut_spread: float = 0.02  # DyRep: cut only when the std of branch weights exceeds this ...
    cut_floor: float = 0.1  # ... and a branch's weight is below the mean and below this
    keep_branches: bool = True  # a board keeps its trained branch tensors between rounds (paper protocol)
    recalibration_batches: int = 20  # BN recalibration passes after an expansion (METHODS §5.a.3: R = 20)
    inner_width: int | None = None  # D of the 1×1→K×K branch (None: C_in, as the code)


@register_strategy
class DynamicFL(SubmodelStrategy):
    """FedAvg of plain uploads; per-board capacity, protocol and DYMM knobs travel in the task's hparams."""

    name = "dynamicfl"
    procedure = "dynamicfl"
    options_type: ClassVar[type[MethodOptions]] = DynamicFLOptions
    options: DynamicFLOptions

    def setup(self) -> None:
        protocol = self.options.protocol
        if protocol not in PROTOCOLS:
            raise ConfigError(f"[method] dynamicfl protocol must be one of {PROTOCOLS}, got {protocol!r}")
        capacities = self.options.capacities
        if not capacities or any(c < 0 for c in capacities):
            raise ConfigError(
                f"[method] dynamicfl capacities must be a non-empty list of ints >= 0, got {list(capacities)!r}"
            )
        self.capacities = list(capacities)
        self.spec = self.full_spec
        self._capacity_log: dict[str, int] = {}  # device -> capacity last assigned (summary)
        self._structures: dict[str, dict[str, list[str]]] = {}  # device -> last reported structure
        self._classes: dict[str, str] = {}  # device -> capacity class label

    @cached_property
    def sites(self) -> list[ConvSite]:
        """The expandable convs of the plain model (found once from one probe pass)."""
        model = build(self.full_spec)
        shape = (self.model.in_channels, self.model.image_size, self.model.image_size)
        return find_sites(model, shape)

    def capacity_of(self, device: DeviceInfo) -> int:
        """Convs this board may expand: what its spare memory affords beside the plain model, else its tier."""
        budget = device_memory_budget(device.memory_budget_bytes, device.profile)
        if budget is not None:
            batch, momentum = self.ctx.batch_size, self.ctx.momentum
            spare = budget - training_memory(self.spec, batch, momentum=momentum)
            if spare <= 0:
                return 0
            return affordable_capacity(
                self.sites,
                spare,
                batch=batch,
                momentum=momentum,
                inner_width=self.options.inner_width,
                limit=self.options.max_capacity,
            )
        if device.tier is not None:
            return self.capacities[min(device.tier, len(self.capacities) - 1)]
        per_tier = max(1.0, self.ctx.num_clients / len(self.capacities))
        return self.capacities[min(int(device.index // per_tier), len(self.capacities) - 1)]

    def spec_for(self, round_index: int, device: DeviceInfo) -> SubmodelSpec:
        return self.spec

    def local_hparams(self, round_index: int, device: DeviceInfo, spec: SubmodelSpec) -> dict[str, Any]:
        hp = super().local_hparams(round_index, device, spec)
        capacity = self.capacity_of(device)
        self._capacity_log[device.device_id] = capacity
        hp.update(
            capacity=capacity,
            round=round_index,
            protocol=self.options.protocol,
            local_weight=self.options.local_weight,
            cut_spread=self.options.cut_spread,
            cut_floor=self.options.cut_floor,
            keep_branches=self.options.keep_branches,
            recalibration_batches=self.options.recalibration_batches,
        )
        if self.options.inner_width is not None:
            hp["inner_width"] = self.options.inner_width
        return hp

    def aggregation_weight(self, result: Result) -> float:
        return float(result.num_samples)

    def eval_targets(self) -> list[EvalTarget]:
        return [EvalTarget("full", self.spec, self.task_weights(self.spec))]

    # -- reports ------------------------------------------------------------------------------
    def round_report(self, round_index: int, accepted: list[tuple[Task, Result]]) -> dict[str, Any]:
        """Per capacity class: boards, convs expanded (after the round's modulation), grown, cut and collapsed.

        The counts are what boards say of themselves: informative only, so a malformed or inflated report is
        clipped to what the model has (it cannot change the aggregate, which uses the validated weights)."""
        by_class: dict[str, Counter[str]] = defaultdict(Counter)
        bound = len(self.sites)
        for task, result in accepted:
            capacity = int(task.hparams.get("capacity", 0))  # the server's own assignment
            label = f"c{capacity}"
            counts = by_class[label]
            counts["boards"] += 1
            for key in ("expanded", "grown", "cut", "collapsed"):
                counts[key] += _count(result.metrics.get(f"dynamicfl_{key}"), bound * 8)
            self._classes[result.device_id] = label
            structure = self._structure_from(result.metrics.get("dynamicfl_structure"))
            if structure is not None:
                self._structures[result.device_id] = structure
        return {"dynamicfl": {label: dict(sorted(c.items())) for label, c in sorted(by_class.items())}}

    def _structure_from(self, raw: Any) -> dict[str, list[str]] | None:
        """A board's reported structure if it names only this model's sites and DBB branches, else None."""
        if not isinstance(raw, str) or len(raw) > 64 * 1024:
            return None
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError:
            return None
        names = {site.name for site in self.sites}
        if not isinstance(parsed, dict) or not set(parsed) <= names:
            return None
        if not all(isinstance(v, list) and set(map(str, v)) <= set(BRANCHES) for v in parsed.values()):
            return None
        return {str(k): sorted(map(str, v)) for k, v in parsed.items()}

    def run_summary(self) -> dict[str, Any]:
        """The final structure each board reported, grouped by capacity class, and how often each conv was
        expanded in that class."""
        classes: dict[str, dict[str, Any]] = {}
        for device, label in sorted(self._classes.items()):
            entry = classes.setdefault(label, {"boards": 0, "expanded_sites": Counter(), "structures": {}})
            structure = self._structures.get(device)  # None: the board never sent a well-formed structure
            entry["boards"] += 1
            entry["expanded_sites"].update((structure or {}).keys())
            entry["structures"][device] = structure
        for entry in classes.values():
            entry["expanded_sites"] = dict(entry["expanded_sites"].most_common())
        return {"dynamicfl": {"protocol": self.options.protocol, "classes": classes}}

    @classmethod
    def describe_trained(cls, method_report: dict[str, Any]) -> str:
        """Per capacity class, the mean number of convs its boards' final structure expands: what they trained
        in the last round's epochs after the modulation (issue 29: report what was trained)."""
        parts = [
            f"{label} {mean:.2f} ({boards} board{'s' if boards != 1 else ''})"
            for label, (mean, boards) in sorted(expanded_by_class(method_report).items())
            if boards
        ]
        return ("convs expanded in the final round's trained structure: " + ", ".join(parts)) if parts else ""

    def state_meta(self) -> dict[str, Any]:
        return {"structures": self._structures, "classes": self._classes}

    def load_state(self, tensors: dict[str, Any], meta: dict[str, Any]) -> None:
        super().load_state(tensors, meta)
        self._structures = {k: dict(v) for k, v in meta.get("structures", {}).items()}
        self._classes = dict(meta.get("classes", {}))


def expanded_by_class(method_report: dict[str, Any]) -> dict[str, tuple[float, int]]:
    """From a run's `method_report` (summary.json): per capacity class label, the mean number of convs its boards'
    final structures expand and how many boards it has (a board without a well-formed structure counts 0)."""
    classes = (method_report.get("dynamicfl") or {}).get("classes") or {}
    out: dict[str, tuple[float, int]] = {}
    for label, entry in classes.items():
        structures = [s or {} for s in (entry.get("structures") or {}).values()]
        mean = sum(len(s) for s in structures) / len(structures) if structures else 0.0
        out[label] = (mean, len(structures))
    return out


def _count(value: Any, bound: int) -> int:
    """A reported count as an int in [0, bound] (0 when it is not a finite number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return 0
    return int(min(max(value, 0), bound))
