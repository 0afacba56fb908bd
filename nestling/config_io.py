"""Write a resolved run config back as TOML, so a run directory says exactly how it was made."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nestling.config import SimConfig


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} as TOML")


def config_to_toml(cfg: SimConfig) -> str:
    lines: list[str] = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        if section == "method":
            lines.append(f"name = {_toml_value(values['name'])}")
            values = values["options"]
        for key, value in values.items():
            if value is None:
                continue
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def write_config(cfg: SimConfig, path: Path) -> None:
    path.write_text(config_to_toml(cfg))
