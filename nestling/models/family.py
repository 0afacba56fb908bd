"""A model family: one registered object that knows everything about one architecture's structure.

Each family builds any of its submodels from a SubmodelSpec, lists its blocks and answers the questions
methods ask (NeFL presets, FeDepth stages, client grouping). A family is its modules: the profiler derives
parameters, MACs and saved activations by running the built submodel on data-less tensors
(nestling/profiler/trace.py), and export derives the inference form by rewriting its module tree
(nestling/export/standalone.py `plain_copy`). The consumers (zoo, profiler, export, simulator, strategies) ask
the registry, so adding an architecture is one module that calls `register_family` (docs/extending.md).

The kernel may not import export, so export hands its folding kit in: `standalone_part(part, kit)` receives
nestling.export.standalone.KIT.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from torch import nn

from nestling.errors import ConfigError, SpecError
from nestling.models.context import BuildContext
from nestling.models.net import BlockInfo, ScalableNet

if TYPE_CHECKING:  # nestling.spec imports nestling.models: a runtime import here would be circular
    from nestling.spec import SubmodelSpec

ExportKit = Any  # nestling.export.standalone.KIT (the kernel does not import export)
NeflPreset = list[tuple[float, tuple[int, ...] | None]]  # (parameter fraction γ, kept blocks or None = all)


@dataclass(frozen=True)
class GrowthCells:
    """Which tensors of a block FedTrans's function-preserving transformations touch (METHODS §4.a.3-4).

    Names are relative to the block (`blocks.{i}.`). Widening replicates the block's growable units: every
    tensor in `rows` is indexed by unit along dim 0 (the producing weight, its bias, a norm between producer
    and consumer with its statistics), and `consumer`'s dim-1 columns are divided by each unit's replication
    count. Deepening zeroes `zeroed` in a freshly built block so its residual branch adds exactly 0.
    Tensors a block does not hold (a conv without bias) are skipped.
    """

    producer: str  # the weight whose output rows are the units (symmetry-breaking noise goes here)
    rows: tuple[str, ...]  # every tensor indexed by unit along dim 0, `producer` included
    consumer: str  # the weight whose input columns are the units
    zeroed: tuple[str, ...]  # tensors zeroed in an inserted block so it is the identity
    inserted_hidden: tuple[int, ...]  # internal width of a block inserted in each stage


class ModelFamily:
    """The interface every architecture implements; subclasses override what their structure needs.

    `build_parts` and `block_infos` are required; nothing else is. The profiler's costs come from running the
    built modules, and `standalone_part` defaults to export's derived form of the part (a frozen copy with the
    kernel's slim layers, Scalers and BN made plain and folded), which keeps whatever the part's forward runs.
    """

    name: str = ""
    paper: str = ""
    groupable: bool = False  # K same-spec clients can train as one grouped network (simulator/grouped.py)
    stem_trains_every_stage: bool = False  # FeDepth §3.a.9: every depth stage also trains the stem
    supports_layout: bool = False  # understands extra["layout"] (per-stage block counts, per-block widths)
    # `supports_layout` families also answer block_hidden; growth_cells lets FedTrans grow them.

    # -- structure -----------------------------------------------------------------------------
    def block_infos(self, image_size: int, extra: dict[str, Any]) -> tuple[BlockInfo, ...]:
        """Global geometry of every residual block, in depth order."""
        raise NotImplementedError(f"model family '{self.name}' does not list its blocks")

    def stage_depths(self, extra: dict[str, Any]) -> tuple[int, ...]:
        """Blocks per stage (NeFL's depth presets keep a prefix of each stage)."""
        counts: dict[int, int] = {}
        for info in self.block_infos(32, extra):
            counts[info.stage] = counts.get(info.stage, 0) + 1
        return tuple(counts[s] for s in sorted(counts))

    def build_parts(
        self, spec: SubmodelSpec, ctx: BuildContext, infos: tuple[BlockInfo, ...], kept: set[int], depth: int
    ) -> tuple[nn.Module, list[nn.Module], dict[int, nn.Module], nn.Module | None]:
        """stem, the first `depth` blocks (those not in `kept` built skipped), exits by block, final head."""
        raise NotImplementedError(f"model family '{self.name}' does not build")

    def build(self, spec: SubmodelSpec) -> ScalableNet:
        """The physically sliced module of `spec` (uninitialised: zoo.build initialises)."""
        if "layout" in spec.model.extra and not self.supports_layout:
            raise ConfigError(
                f"[model] model family '{self.name}' cannot build an extra.layout (ResNet families and the ViT can)"
            )
        infos = self.block_infos(spec.model.image_size, spec.model.extra)
        kept, depth = kept_blocks(spec, len(infos))
        ctx = BuildContext(spec.model, spec.width)
        stem, blocks, exits, head = self.build_parts(spec, ctx, infos, kept, depth)
        return ScalableNet(stem, blocks, exits, head, infos, spec.model.arch)

    # -- export --------------------------------------------------------------------------------
    def standalone_part(self, part: nn.Module, kit: ExportKit) -> nn.Module | None:
        """The inference-only equivalent of a stem, block or head; an override may return None for a block that
        is an identity in inference (the default never does: a skipped block may still hold a projection)."""
        return kit.plain_copy(part)

    # -- method questions ----------------------------------------------------------------------
    def block_hidden(self, image_size: int, extra: dict[str, Any]) -> tuple[int, ...]:
        """Every block's global growable internal width, in depth order (what extra["layout"] sets)."""
        raise ConfigError(f"[model] model family '{self.name}' has no per-block internal width (no layout)")

    def growth_cells(self, extra: dict[str, Any]) -> GrowthCells | None:
        """How FedTrans widens and deepens this family's blocks, or None when it cannot grow them."""
        return None

    def nefl_depth_preset(self) -> list[tuple[int, ...]] | None:
        """NeFL-D's published kept-block sets (four smaller submodels), or None for the generic rule."""
        return None

    def nefl_wd_preset(self) -> NeflPreset | None:
        """NeFL-WD's published (γ, kept blocks) per submodel, smallest first, or None for the generic rule."""
        return None


_REGISTRY: dict[str, ModelFamily] = {}
F = TypeVar("F", bound=Callable[[], ModelFamily])


def register_family(factory: F) -> F:
    """Decorator: register the family `factory()` returns under its `name` (a class or a function)."""
    family = factory()
    if not isinstance(family, ModelFamily) or not family.name:
        raise ConfigError(f"{getattr(factory, '__name__', factory)!r} must return a named ModelFamily")
    if family.name in _REGISTRY:
        raise ConfigError(f"[model] model family '{family.name}' is registered twice")
    _REGISTRY[family.name] = family
    return factory


def unregister_family(name: str) -> None:
    """Remove a family (tests that register a throw-away family clean up with this)."""
    _REGISTRY.pop(name, None)


def family_of(arch: str) -> ModelFamily:
    """The registered family of model `arch`."""
    try:
        return _REGISTRY[arch]
    except KeyError:
        raise ConfigError(f"[model] unknown model '{arch}' (known: {', '.join(_REGISTRY)})") from None


def registered_families() -> dict[str, ModelFamily]:
    """Every registered family by name, in registration order."""
    return dict(_REGISTRY)


def kept_blocks(spec: SubmodelSpec, count: int) -> tuple[set[int], int]:
    """Executed block indices and the depth of `spec` in a model of `count` blocks, with clear errors."""
    depth = count if spec.depth is None else spec.depth
    if depth > count:
        raise SpecError(f"depth {depth} exceeds the {count} blocks of {spec.model.arch}")
    kept = set(range(count)) if spec.blocks is None else set(spec.blocks)
    outside = sorted(b for b in kept if not 0 <= b < count)
    if outside:
        raise SpecError(f"blocks {outside} do not exist in {spec.model.arch} (0..{count - 1})")
    kept &= set(range(depth))
    if not kept:
        raise SpecError(f"submodel of {spec.model.arch} keeps no residual block")
    late_exits = [e for e in spec.exits if e >= depth]
    if late_exits:
        raise SpecError(f"exits {late_exits} lie beyond the submodel's depth {depth}")
    if spec.block_widths is not None and len(spec.block_widths) != count:
        raise SpecError(
            f"block_widths has {len(spec.block_widths)} entries, {spec.model.arch} has {count} blocks"
        )
    return kept, depth


def kept_from_stage_masks(masks: list[list[int]]) -> tuple[int, ...]:
    """Global indices of the blocks a per-stage 0/1 mask keeps (NeFL's published depth masks)."""
    kept: list[int] = []
    index = 0
    for stage in masks:
        for bit in stage:
            if bit:
                kept.append(index)
            index += 1
    return tuple(kept)


def first_n_per_stage(depths: tuple[int, ...], per_stage: tuple[int, ...]) -> tuple[int, ...]:
    """Global indices of the first n blocks of every stage."""
    kept: list[int] = []
    offset = 0
    for depth, n in zip(depths, per_stage):
        kept.extend(range(offset, offset + min(n, depth)))
        offset += depth
    return tuple(kept)
