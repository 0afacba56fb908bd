"""A method's `[method]` options as one typed record, built once from the run's table with the defaults on its fields.

Each strategy declares a frozen dataclass of its options (`options_type`); `MethodOptions.from_table` refuses a
key the record does not declare and a value of the wrong kind, naming both, and returns the record with every
value in its declared type (a TOML integer in a float option becomes that float; a list a tuple), so strategies
read `self.options.flex`, never a dict.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from nestling.errors import ConfigError
from nestling.typed_values import accepts, arms, as_declared, element

Record = TypeVar("Record", bound="MethodOptions")

_NAMES = {bool: "bool", int: "int", float: "int or float", str: "str", type(None): "None"}
_ELEMENTS = {float: "a list of numbers", int: "a list of integers", Any: "a list"}


def kind_name(kind: Any) -> str:
    """How an error names what an option takes: 'int or float', 'str or a list of numbers', ..."""
    names = []
    for arm in arms(kind):
        inner = element(arm)
        names.append(_ELEMENTS.get(inner, "a list") if inner is not None else _NAMES.get(arm, str(arm)))
    return " or ".join(names)


@dataclass(frozen=True)
class MethodOptions:
    """A method without options; every method's record subclasses it and declares its fields with defaults."""

    @classmethod
    def from_table(cls: type[Record], method: str, table: Mapping[str, Any]) -> Record:
        """The record of a `[method]` table; a ConfigError names an unknown option or a value of the wrong kind."""
        hints = typing.get_type_hints(cls)
        declared = [f.name for f in dataclasses.fields(cls)]
        unknown = set(table) - set(declared)
        if unknown:
            raise ConfigError(
                f"[method] {method} has no options {sorted(unknown)} "
                f"(known: {', '.join(sorted(declared)) or 'none'})"
            )
        values = {}
        for key, value in table.items():
            if not accepts(hints[key], value):
                raise ConfigError(
                    f"[method] {method} option {key} must be {kind_name(hints[key])}, got {value!r}"
                )
            values[key] = as_declared(hints[key], value)
        return cls(**values)

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every option with its default (the one place they are declared)."""
        return {f.name: f.default for f in dataclasses.fields(cls)}

    @classmethod
    def kinds(cls) -> dict[str, Any]:
        """Every option's annotation, resolved."""
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}
