"""The one checker behind typed options and typed hyper-parameters: wrong types refused, values converted."""

from __future__ import annotations

import math
from typing import Any

import pytest

from nestling.typed_values import accepts, as_declared


@pytest.mark.parametrize(
    ("kind", "value", "ok"),
    [
        (float, 1, True),
        (float, True, False),  # bool is no number
        (float, math.inf, False),
        (float, math.nan, False),
        (int, 1.0, False),
        (int | None, None, True),
        (tuple[float, ...], [1, 2.5], True),
        (tuple[float, ...], [1, "x"], False),
        (list[int], (1, 2), True),
        (str | tuple[float, ...], "fair", True),
        (dict[str, Any], {"a": 1}, True),
        (dict[str, Any], [1], False),
        (Any, object(), True),
    ],
)
def test_accepts_the_declared_kind_only(kind: Any, value: Any, ok: bool) -> None:
    assert accepts(kind, value) is ok


def test_values_come_back_in_their_declared_type() -> None:
    assert as_declared(float, 3) == 3.0 and isinstance(as_declared(float, 3), float)
    assert as_declared(tuple[float, ...], [1, 2]) == (1.0, 2.0)
    assert as_declared(list[float], (1,)) == [1.0]
    assert as_declared(str | tuple[float, ...], [1]) == (1.0,)
    assert as_declared(int | None, None) is None


def test_an_annotation_it_cannot_check_is_an_error_not_a_pass() -> None:
    with pytest.raises(TypeError, match="unsupported field annotation"):
        accepts(set[int], {1})
