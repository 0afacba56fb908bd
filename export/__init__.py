"""Deployable submodels: folded standalone modules, ONNX / TensorRT bundles with parity and latency, `infer`.

Attributes load lazily: `export.infer` and `export.bundle` must import on a board without PyTorch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ExportData": "nestling.export.options",
    "ExportOptions": "nestling.export.options",
    "export_submodel": "nestling.export.pipeline",
    "export_target": "nestling.export.pipeline",
    "load_export_data": "nestling.export.options",
    "build_standalone": "nestling.export.standalone",
    "plan_outputs": "nestling.export.standalone",
    "open_checkpoint": "nestling.export.source",
    "export_main": "nestling.export.cli",
    "infer_main": "nestling.export.infer",
    "read_bundle": "nestling.export.bundle",
}

__all__ = [
    "ExportData",
    "ExportOptions",
    "build_standalone",
    "export_main",
    "export_submodel",
    "export_target",
    "infer_main",
    "load_export_data",
    "open_checkpoint",
    "plan_outputs",
    "read_bundle",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'export' has no attribute '{name}'")
    return getattr(importlib.import_module(_LAZY[name]), name)
