"""Argparse types for the numbers a command takes: a negative budget, a zero batch or `nan` is refused where
it is typed (`argument --budget-mb: must be a positive number, got '-5'`), never planned with."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

N = TypeVar("N", int, float)


def _checked(kind: type[N], test: Callable[[N], bool], wanted: str) -> Callable[[str], N]:
    """An argparse type: `raw` as `kind`, finite and passing `test`, else an error saying what was wanted."""

    def parse(raw: str) -> N:
        try:
            value = kind(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {raw!r}") from None
        if not math.isfinite(value) or not test(value):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {raw!r}")
        return value

    return parse


positive_int = _checked(int, lambda v: v > 0, "a positive whole number")
non_negative_int = _checked(int, lambda v: v >= 0, "a whole number >= 0")
positive_float = _checked(float, lambda v: v > 0, "a positive number")
non_negative_float = _checked(float, lambda v: v >= 0, "a number >= 0")
share = _checked(float, lambda v: 0 < v <= 1, "a share in (0, 1]")
any_float = _checked(float, lambda v: True, "a finite number")

__all__ = [
    "any_float",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "share",
]
