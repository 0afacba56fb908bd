"""A model state whose float32 tensors live in one buffer: what a task and a result carry.

A tinycnn state is 40 tensors of 5,300 values in all, a ResNet-20 one 100-odd. Everything the server does per
result that touches every tensor (the update screen: result − task, its norm, the BN statistics' values) pays a
C++ dispatch per tensor, and done per tensor that cost exceeds the arithmetic many times over. Packed, the same
work is one vector operation: result.buffer − task.buffer.

`PackedTensors` is an ordinary `dict[str, Tensor]` to every reader: its float32 tensors are views of `buffer`,
trained tensors first (sorted by name), then BN running statistics (sorted by name, running variances last), as
`layout` records. Any change to the mapping itself (setting, deleting, updating a key) drops the packing and
leaves a plain-acting dict, so the buffer never disagrees with the tensors it claims to hold; in-place writes into
a tensor write the buffer. Layouts are interned: two states with the same keys and shapes share one `PackLayout` object, so
"same layout" is an identity test.

Packing happens where a state is made: `slicing.extract` (tasks), the trainer (results), the wire decoder
(results from boards). It costs one allocation and one multi-tensor copy there, in place of one allocation per
tensor for tasks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from nestling.models.layers import is_running_statistic, is_running_variance

Shapes = tuple[tuple[int, ...], ...]


class PackLayout:
    """Which keys a buffer holds, in order, with their shapes: `trained` trained tensors (`trained_size`
    values), then the running statistics. `complete`: every floating tensor of the state is in the buffer.
    Made by `layout_for` only (interned), never changed; its parts are made once, so readers get the same tuple
    objects every time (the direction screen caches positions by their identity)."""

    __slots__ = (
        "complete",
        "counts",
        "keys",
        "shapes",
        "size",
        "statistic_keys",
        "statistic_shapes",
        "trained",
        "trained_keys",
        "trained_shapes",
        "trained_size",
    )

    def __init__(self, keys: tuple[str, ...], shapes: Shapes, trained: int, complete: bool) -> None:
        self.keys = keys
        self.shapes = shapes
        self.trained = trained
        self.complete = complete
        self.counts = tuple(math.prod(shape) for shape in shapes)
        self.trained_size = sum(self.counts[:trained])
        self.size = sum(self.counts)
        self.trained_keys, self.trained_shapes = keys[:trained], shapes[:trained]
        self.statistic_keys, self.statistic_shapes = keys[trained:], shapes[trained:]


_LAYOUTS: dict[tuple[tuple[str, ...], Shapes, int, bool], PackLayout] = {}
_MAX_LAYOUTS = 4096  # a fleet has a handful of submodel layouts; a bound keeps odd callers from growing it


def layout_for(keys: tuple[str, ...], shapes: Shapes, trained: int, complete: bool) -> PackLayout:
    """The one PackLayout for these keys and shapes (interned)."""
    signature = (keys, shapes, trained, complete)
    layout = _LAYOUTS.get(signature)
    if layout is None:
        if len(_LAYOUTS) >= _MAX_LAYOUTS:
            _LAYOUTS.clear()
        layout = _LAYOUTS[signature] = PackLayout(keys, shapes, trained, complete)
    return layout


def views_of(buffer: torch.Tensor, shapes: Iterable[tuple[int, ...]]) -> list[torch.Tensor]:
    """Views of a flat buffer shaped like each of `shapes`, laid end to end (a packed state's tensors, a screen's
    update row)."""
    views, offset = [], 0
    for shape in shapes:
        count = math.prod(shape)
        views.append(buffer[offset : offset + count].view(shape))
        offset += count
    return views


class PackedTensors(dict[str, torch.Tensor]):
    """A state dict whose float32 tensors are views of `buffer` in `layout` order (see the module doc).

    `buffer` and `layout` are None once the mapping has been changed: readers then treat it as any dict.
    `trained` and `statistics` are the buffer's two parts, made once (a view is a C++ call a reader need
    not pay)."""

    __slots__ = ("buffer", "layout", "statistics", "trained")

    def __init__(
        self, items: Iterable[tuple[str, torch.Tensor]], buffer: torch.Tensor, layout: PackLayout
    ) -> None:
        super().__init__(items)
        self.buffer: torch.Tensor | None = buffer
        self.layout: PackLayout | None = layout
        self.trained: torch.Tensor | None = buffer[: layout.trained_size]
        self.statistics: torch.Tensor | None = buffer[layout.trained_size :]

    def _unpack(self) -> None:
        self.buffer = self.layout = self.trained = self.statistics = None

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self._unpack()
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self._unpack()
        super().__delitem__(key)

    def __ior__(self, other: Any) -> PackedTensors:  # type: ignore[override,misc]
        self._unpack()
        super().update(other)
        return self

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._unpack()
        super().update(*args, **kwargs)

    def pop(self, *args: Any) -> Any:
        self._unpack()
        return super().pop(*args)

    def popitem(self) -> tuple[str, torch.Tensor]:
        self._unpack()
        return super().popitem()

    def clear(self) -> None:
        self._unpack()
        super().clear()

    def setdefault(self, key: str, default: Any = None) -> Any:
        self._unpack()
        return super().setdefault(key, default)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (process pools, Ray) with its buffer once; rebuilt as views of it on the other side."""
        if self.buffer is None or self.layout is None:
            return (dict, (list(self.items()),))
        layout = self.layout
        packed = set(layout.keys)
        others = [(k, v) for k, v in self.items() if k not in packed]
        return (
            _rebuild,
            (self.buffer, layout.keys, layout.shapes, layout.trained, layout.complete, others, list(self)),
        )


def _rebuild(
    buffer: torch.Tensor,
    keys: tuple[str, ...],
    shapes: Shapes,
    trained: int,
    complete: bool,
    others: list[tuple[str, torch.Tensor]],
    order: list[str],
) -> PackedTensors:
    layout = layout_for(keys, shapes, trained, complete)
    tensors = dict(zip(keys, views_of(buffer, shapes), strict=True))
    tensors.update(others)
    return PackedTensors(((k, tensors[k]) for k in order), buffer, layout)


def pack(state: Mapping[str, torch.Tensor]) -> PackedTensors:
    """A packed copy of `state`: its float32 tensors copied into one buffer, the others cloned."""
    packed_keys = [k for k, v in state.items() if v.dtype == torch.float32]
    trained = sorted(k for k in packed_keys if not is_running_statistic(k))
    # running variances last: the screen's negative-variance test reads one trailing slice
    statistics = sorted(
        (k for k in packed_keys if is_running_statistic(k)), key=lambda k: (is_running_variance(k), k)
    )
    keys = (*trained, *statistics)
    shapes = tuple(tuple(state[k].shape) for k in keys)
    complete = len(keys) == sum(1 for v in state.values() if v.is_floating_point())
    layout = layout_for(keys, shapes, len(trained), complete)
    buffer = torch.empty(layout.size, dtype=torch.float32)
    views = views_of(buffer, shapes)
    if views:
        with torch.no_grad():
            torch._foreach_copy_(views, [state[k] for k in keys])
    by_key = dict(zip(keys, views, strict=True))
    # The others are copied too: a task must not share a tensor with the global model (training increments
    # BN's num_batches_tracked in place).
    return PackedTensors(
        ((k, by_key[k] if k in by_key else v.clone()) for k, v in state.items()), buffer, layout
    )


def packing(state: Mapping[str, torch.Tensor]) -> PackedTensors | None:
    """`state` when it is an intact PackedTensors (buffer, layout and parts set), else None."""
    if type(state) is PackedTensors and state.layout is not None:
        return state
    return None
