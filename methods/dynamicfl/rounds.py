"""One DynamicFL local round on a board, both protocols of METHODS §5.a.6, around a caller's training epoch.

The model comes in as the plain global model and leaves as the plain model again (every DBB fused, its
bias folded), with the same state-dict keys and shapes, ready for FedAvg. What happens in between:

* `released_round` (released code, stateless): epoch 0 on the plain model recording salience, grow the
  top-c convs, train the other E − 1 epochs, fuse.
* `paper_round` (paper, stateful; `DynamicState` carries ζ_i, S^l and the trained branches): round 0
  grows c convs bottom to top and trains E epochs; later rounds rebuild last round's structure around the
  new global weights (REP(ω_g, ζ_i)), train one epoch for S^g, modulate (DYMM), train E − 1 more epochs
  for S^l; a board whose capacity fell below its structure re-chooses from S^l and trains E epochs.

`train_epoch(model, after_backward)` is the caller's: it trains one local epoch and calls
`after_backward()` after every backward pass, before the optimiser step. It must build its optimiser
from `model.parameters()` on each call, since the structure may change between epochs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nestling.methods.dynamicfl.expansion import RECALIBRATION_ITERATIONS
from nestling.methods.dynamicfl.modulation import (
    LOCAL_WEIGHT,
    CutRule,
    ModulationPlan,
    apply_plan,
    combine_salience,
    current_structure,
    dymm_plan,
    released_plan,
    shrink_structure,
)
from nestling.methods.dynamicfl.salience import SalienceMeter, bottom_up
from nestling.methods.dynamicfl.sites import ConvSite, branch_state, expand_model, expanded_blocks, fuse_model
from nestling.methods.dynamicfl.state import DynamicState

TrainEpoch = Callable[[nn.Module, Callable[[], None]], None]


@dataclass
class RoundOutcome:
    """What a round did to the structure, for reports: grown, cut and collapsed convs, the trained structure."""

    plan: ModulationPlan
    structure: dict[str, tuple[str, ...]]
    local_salience: dict[str, float]
    global_salience: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.plan.to_dict(),
            "structure": {k: list(v) for k, v in self.structure.items()},
            "expanded": len(self.structure),
            "cut_branches": sum(len(v) for v in self.plan.cut.values()),
        }


def _train(
    model: nn.Module, sites: Sequence[ConvSite], train_epoch: TrainEpoch, epochs: int
) -> dict[str, float]:
    """Train `epochs` epochs; the salience of the last one (empty if none)."""
    local: dict[str, float] = {}
    for epoch in range(epochs):
        if epoch == epochs - 1:
            meter = SalienceMeter(model, sites)
            train_epoch(model, meter.record)
            local = meter.means()
        else:
            train_epoch(model, lambda: None)
    return local


def _check(epochs: int, capacity: int) -> None:
    if epochs < 1:
        raise ValueError(f"a DynamicFL round needs at least one local epoch, got {epochs}")
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")


def released_round(
    model: nn.Module,
    sites: Sequence[ConvSite],
    capacity: int,
    epochs: int,
    train_epoch: TrainEpoch,
    *,
    calibration: Sequence[torch.Tensor] | None = None,
    iterations: int = RECALIBRATION_ITERATIONS,
    generator: torch.Generator | None = None,
    inner_width: int | None = None,
) -> RoundOutcome:
    """The released code's round; capacity 0 is plain local training of the untouched model."""
    _check(epochs, capacity)
    meter = SalienceMeter(model, sites)
    train_epoch(model, meter.record)
    first = meter.means()
    plan = released_plan(first, capacity, sites)
    apply_plan(
        model,
        sites,
        plan,
        batches=calibration,
        iterations=iterations,
        generator=generator,
        inner_width=inner_width,
    )
    local = _train(model, sites, train_epoch, epochs - 1) or first
    structure = current_structure(model)
    fuse_model(model)
    return RoundOutcome(plan, structure, local)


def paper_round(
    model: nn.Module,
    sites: Sequence[ConvSite],
    state: DynamicState,
    capacity: int,
    epochs: int,
    train_epoch: TrainEpoch,
    *,
    round_index: int,
    calibration: Sequence[torch.Tensor] | None = None,
    iterations: int = RECALIBRATION_ITERATIONS,
    generator: torch.Generator | None = None,
    inner_width: int | None = None,
    local_weight: float = LOCAL_WEIGHT,
    cut_rule: CutRule | None = None,
    keep_branches: bool = True,
) -> RoundOutcome:
    """The paper's round (updates `state` in place); `cut_rule=None` uses DyRep's default rule."""
    _check(epochs, capacity)
    rule = CutRule() if cut_rule is None else cut_rule
    kept = state.branches if keep_branches else {}

    def rebuild(structure: Mapping[str, Sequence[str] | None]) -> None:
        """REP(ω_g, ζ): the global model in `structure`, stored branches restored where the board has them."""
        expand_model(
            model,
            sites,
            structure,
            batches=calibration,
            iterations=iterations,
            generator=generator,
            inner_width=inner_width,
            branch_states={k: v for k, v in kept.items() if k in structure},
        )

    global_: dict[str, float] = {}
    if not state.started:
        plan = ModulationPlan(grow=bottom_up(sites, capacity))
        rebuild(dict.fromkeys(plan.grow))
        remaining = epochs
    elif capacity < len(state.structure):
        chosen = shrink_structure(state.structure, state.local_salience, capacity, sites)
        rebuild(chosen)
        plan = ModulationPlan(
            grow=tuple(n for n in chosen if n not in state.structure),
            collapse=tuple(n for n in state.structure if n not in chosen),
        )
        remaining = epochs
    else:
        rebuild(state.structure)
        meter = SalienceMeter(model, sites)
        train_epoch(model, meter.record)
        global_ = meter.means()
        redundant = {name: rule.redundant(dbb) for name, dbb in expanded_blocks(model).items()}
        combined = combine_salience(state.local_salience, global_, local_weight)
        plan = dymm_plan(current_structure(model), combined, capacity, sites, redundant)
        apply_plan(
            model,
            sites,
            plan,
            batches=calibration,
            iterations=iterations,
            generator=generator,
            inner_width=inner_width,
        )
        remaining = epochs - 1
    local = _train(model, sites, train_epoch, remaining) or global_
    structure = current_structure(model)
    state.round = int(round_index)
    state.capacity = int(capacity)
    state.structure = structure
    state.branches = (
        {name: branch_state(dbb) for name, dbb in expanded_blocks(model).items()} if keep_branches else {}
    )
    state.global_salience = dict(global_)
    state.remember_local(round_index, local)
    fuse_model(model)
    return RoundOutcome(plan, structure, local, dict(global_))
