"""Function-preserving growth of a growable model: Net2WiderNet and identity-block insertion (METHODS §4.a.3-4).

Both take a state dict and its ModelConfig and return a new (config, state, provenance) without touching the
parent. The state's dtype is kept (float32 or float64), so preservation can be checked at either precision.
Which tensors they touch is the family's `growth_cells` (a ResNet block's conv1/BN/conv2, a ViT encoder
block's fc1/fc2 and output projections); the operations themselves are family-agnostic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from nestling.errors import ConfigError
from nestling.methods.fedtrans.cells import (
    CellOrigin,
    Layout,
    Provenance,
    State,
    cell_of_key,
    cell_parameter_count,
    cell_prefix,
    compose,
    growth_cells,
    identity_provenance,
    layout_of,
    with_layout,
)
from nestling.models.config import ModelConfig
from nestling.models.roles import STEP, roles_of

OPERATIONS = ("widen", "deepen")


@dataclass(frozen=True)
class Grown:
    """A transformed model: its config (with the layout a board builds), weights and cell provenance."""

    config: ModelConfig
    state: State
    provenance: Provenance


def _check_state(state: Mapping[str, torch.Tensor], config: ModelConfig, layout: Layout) -> None:
    blocks = sum(layout.stage_blocks)
    producer = growth_cells(config).producer
    if f"{cell_prefix(blocks - 1)}{producer}" not in state or f"{cell_prefix(blocks)}{producer}" in state:
        raise ConfigError(f"the state does not hold the {blocks} blocks its config {config.arch} describes")


def widen(
    model_state: Mapping[str, torch.Tensor],
    config: ModelConfig,
    cell: int,
    factor: float = 2.0,
    rng: torch.Generator | None = None,
    *,
    noise: float = 0.0,
) -> Grown:
    """Net2WiderNet on block `cell`'s internal width H → round(H·factor) (METHODS §4.a.3).

    New unit j copies a uniformly drawn original unit g(j) (the producer's rows and bias, a BN's affine and
    running statistics between producer and consumer); the consumer's input columns are divided by the
    replication count c(g(j)), originals included, so the block computes the same function (ResNet: conv1 →
    BN → ReLU → conv2; ViT: fc1 → GELU → fc2). `noise` > 0 adds N(0, (noise·std(producer))²) to the copied
    producer rows to break the replicas' symmetry; it breaks exact preservation, so it is off by default.
    """
    recipe = growth_cells(config)
    layout = layout_of(config)
    _check_state(model_state, config, layout)
    if not 0 <= cell < len(layout.block_hidden):
        raise ConfigError(f"cannot widen cell {cell}: the model has cells 0..{len(layout.block_hidden) - 1}")
    if noise < 0:
        raise ConfigError(f"widen noise must be >= 0, got {noise}")
    old = layout.block_hidden[cell]
    new = round(old * factor)
    if new <= old:
        raise ConfigError(f"widen factor {factor} does not grow cell {cell}'s width {old}")
    generator = rng if rng is not None else torch.Generator().manual_seed(0)
    source = torch.cat([torch.arange(old), torch.randint(0, old, (new - old,), generator=generator)])
    counts = torch.bincount(source, minlength=old)

    prefix = cell_prefix(cell)
    state: State = {key: tensor.clone() for key, tensor in model_state.items()}
    for name in recipe.rows:
        if f"{prefix}{name}" in state:
            state[f"{prefix}{name}"] = state[f"{prefix}{name}"][source].clone()
    producer = state[f"{prefix}{recipe.producer}"]
    if noise > 0:
        scale = noise * float(producer[:old].std())
        fresh = torch.randn(producer[old:].shape, generator=generator, dtype=torch.float64) * scale
        producer[old:] += fresh.to(producer.dtype)
    consumer = state[f"{prefix}{recipe.consumer}"]
    divisor = counts[source].to(consumer.dtype).reshape(1, -1, *([1] * (consumer.dim() - 2)))
    state[f"{prefix}{recipe.consumer}"] = consumer[:, source] / divisor

    hidden = list(layout.block_hidden)
    hidden[cell] = new
    grown = with_layout(config, Layout(layout.stage_blocks, tuple(hidden)))
    provenance = list(identity_provenance(len(hidden)))
    fraction = cell_parameter_count(model_state, cell) / cell_parameter_count(state, cell)
    divisors = tuple(float(c) for c in counts.tolist())
    provenance[cell] = CellOrigin("widened", cell, fraction, recipe.consumer, divisors)
    return Grown(grown, state, tuple(provenance))


def deepen(
    model_state: Mapping[str, torch.Tensor],
    config: ModelConfig,
    stage: int,
    position: int,
    rng: torch.Generator | None = None,
) -> Grown:
    """Insert an identity residual block at `position` (1..blocks) of `stage` (METHODS §4.a.4, DECISION).

    The new block is freshly initialised like the zoo's models (from `rng`), then its residual branch is
    zeroed at its last layer (the family's `growth_cells().zeroed`): BasicBlock's last BN γ = β = 0 (the
    branch adds 0, and ReLU(0 + x) = x because x is already a ReLU output), PreActBlock's conv2 = 0 (its
    branch has no BN after conv2; zeroing bn2 would leave the branch without a gradient), the ViT encoder
    block's attention proj and MLP fc2. Exact in train and eval mode. Position 0 is refused: a ResNet stage's
    first block carries the stride and projection, and moving it would change the function (FedTrans inserts
    after a selected block, so it never asks for position 0).
    """
    recipe = growth_cells(config)
    layout = layout_of(config)
    _check_state(model_state, config, layout)
    if not 0 <= stage < len(layout.stage_blocks):
        raise ConfigError(
            f"cannot deepen stage {stage}: the model has stages 0..{len(layout.stage_blocks) - 1}"
        )
    if not 1 <= position <= layout.stage_blocks[stage]:
        raise ConfigError(
            f"cannot insert a block at position {position} of stage {stage}: "
            f"positions 1..{layout.stage_blocks[stage]} keep the stage's strided first block in place"
        )
    inserted = layout.stage_start(stage) + position
    blocks = list(layout.stage_blocks)
    blocks[stage] += 1
    hidden = list(layout.block_hidden)
    hidden.insert(inserted, recipe.inserted_hidden[stage])
    grown = with_layout(config, Layout(tuple(blocks), tuple(hidden)))

    state: State = {}
    for key, tensor in model_state.items():
        cell = cell_of_key(key)
        if cell is not None and cell >= inserted:
            key = f"{cell_prefix(cell + 1)}{key.split('.', 2)[2]}"
        state[key] = tensor.clone()
    dtype = next(t.dtype for t in model_state.values() if t.is_floating_point())
    for name, tensor in _fresh_block(grown, inserted, rng, recipe.zeroed).items():
        state[f"{cell_prefix(inserted)}{name}"] = tensor.to(dtype) if tensor.is_floating_point() else tensor

    provenance: list[CellOrigin] = []
    for cell in range(len(hidden)):
        if cell == inserted:
            provenance.append(CellOrigin("inserted", None, 0.0))
        else:
            provenance.append(CellOrigin("inherited", cell if cell < inserted else cell - 1, 1.0))
    return Grown(grown, state, tuple(provenance))


def _fresh_block(
    config: ModelConfig, cell: int, rng: torch.Generator | None, zeroed: tuple[str, ...]
) -> State:
    """Block `cell` of `config` built and initialised like the zoo does, from a seed drawn from `rng`."""
    from nestling.models.zoo import build  # the zoo imports every family module: import on use
    from nestling.spec import SubmodelSpec

    generator = rng if rng is not None else torch.Generator().manual_seed(0)
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
    with torch.random.fork_rng(devices=[]):  # the caller's global RNG stream stays untouched
        torch.manual_seed(seed)
        block = build(SubmodelSpec(config)).blocks[cell]
    fresh = {name: tensor.detach().clone() for name, tensor in block.state_dict().items()}
    for name in zeroed:
        if name in fresh:
            fresh[name].zero_()
    roles = roles_of(block)
    for name, tensor in fresh.items():
        if roles[name] == STEP:  # step sizes at their start value, whatever the block calls them
            tensor.fill_(1.0)
    return fresh


def next_operation(done: int, first: str = "widen") -> str:
    """The alternating schedule of one cell (METHODS §4.a.2 8d; AMBIG-13 DECISION: widen first)."""
    if first not in OPERATIONS:
        raise ConfigError(f"the transform schedule starts with one of {OPERATIONS}, got {first!r}")
    second = OPERATIONS[1 - OPERATIONS.index(first)]
    return first if done % 2 == 0 else second


@dataclass(frozen=True)
class Transformed(Grown):
    """A transformation of several cells: also every cell's count of operations done (the schedule's state)."""

    operations_done: tuple[int, ...] = ()
    applied: tuple[tuple[str, int], ...] = ()  # (operation, parent cell) in the order applied


def transform(
    model_state: Mapping[str, torch.Tensor],
    config: ModelConfig,
    cells: Sequence[int],
    operations_done: Sequence[int],
    rng: torch.Generator,
    *,
    widen_factor: float = 2.0,
    deepen_count: int = 1,
    first: str = "widen",
    noise: float = 0.0,
) -> Transformed:
    """Apply each selected cell's next operation (METHODS §4.a.2 8c-e): M* from the parent's weights.

    Widening keeps cell indices, so every widen runs first; deepening inserts `deepen_count` identity blocks
    right after the selected cell, from the deepest cell backwards so earlier indices stay valid. The
    returned provenance and `operations_done` are relative to the parent (inserted cells start at 0).
    """
    layout = layout_of(config)
    count = len(layout.block_hidden)
    if len(operations_done) != count:
        raise ConfigError(f"operations_done has {len(operations_done)} entries, the model has {count} cells")
    chosen = sorted(set(cells))
    if not chosen or chosen[0] < 0 or chosen[-1] >= count:
        raise ConfigError(
            f"cells to transform must be a non-empty subset of 0..{count - 1}, got {list(cells)}"
        )
    if deepen_count < 1:
        raise ConfigError(f"deepen_count must be >= 1, got {deepen_count}")
    plan = {cell: next_operation(operations_done[cell], first) for cell in chosen}
    state: State = dict(model_state)
    current = config
    provenance = identity_provenance(count)
    done = list(operations_done)
    applied: list[tuple[str, int]] = []
    for cell in chosen:
        if plan[cell] == "widen":
            step = widen(state, current, cell, widen_factor, rng, noise=noise)
            state, current, provenance = step.state, step.config, compose(provenance, step.provenance)
            done[cell] += 1
            applied.append(("widen", cell))
    for cell in reversed(chosen):
        if plan[cell] == "deepen":
            stage, position = layout.stage_of(cell)
            for _ in range(deepen_count):
                step = deepen(state, current, stage, position + 1, rng)
                state, current, provenance = step.state, step.config, compose(provenance, step.provenance)
                done.insert(cell + 1, 0)
            done[cell] += 1
            applied.append(("deepen", cell))
    return Transformed(current, state, provenance, tuple(done), tuple(applied))
