"""Whether a config or JSON value fits a typed record's field annotation, and the value in the declared type.

One checker for every typed record built from outside input: a method's `[method]` options
(server/strategies/options.py) and a task's hyper-parameters (nestling/task_params.py). bool is never a number,
floats must be finite, an integer in a float field becomes that float, a list in a tuple field a tuple.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any


def arms(kind: Any) -> tuple[Any, ...]:
    """The alternatives of a union annotation, or the annotation alone."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return typing.get_args(kind)
    return (kind,)


def element(kind: Any) -> Any | None:
    """X of `tuple[X, ...]` or `list[X]` (Any for a bare tuple or list), else None."""
    origin = typing.get_origin(kind) or kind
    if origin in (tuple, list):
        args = typing.get_args(kind)
        return args[0] if args else Any
    return None


def accepts(kind: Any, value: Any) -> bool:
    """Whether `value` fits the annotation `kind`."""
    if len(arms(kind)) > 1:
        return any(accepts(arm, value) for arm in arms(kind))
    inner = element(kind)
    if inner is not None:
        return isinstance(value, (list, tuple)) and all(accepts(inner, v) for v in value)
    if kind is Any:
        return True
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind is str:
        return isinstance(value, str)
    if kind is dict or typing.get_origin(kind) is dict:
        return isinstance(value, dict)
    raise TypeError(f"unsupported field annotation {kind!r}")


def as_declared(kind: Any, value: Any) -> Any:
    """An accepted value in its declared type: the first union arm that accepts it; an integer in a float field
    becomes that float; a list or tuple becomes the field's container of converted elements."""
    arm = next((arm for arm in arms(kind) if accepts(arm, value)), kind)
    if arm is float:
        return float(value)
    inner = element(arm)
    if inner is not None and isinstance(value, (list, tuple)):
        items = [as_declared(inner, v) for v in value]
        return tuple(items) if (typing.get_origin(arm) or arm) is tuple else items
    return value
