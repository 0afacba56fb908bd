"""Deployable submodels: folded standalone modules, ONNX / TensorRT bundles with parity and latency, `infer`.

Attributes load lazily: `export.infer` and `export.bundle` must import on a board without PyTorch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ExportData": "export.options",
    "ExportOptions": "export.options",
    "export_submodel": "export.pipeline",
    "export_target": "export.pipeline",
    "load_export_data": "export.options",
    "build_standalone": "export.standalone",
    "plan_outputs": "export.standalone",
    "open_checkpoint": "export.source",
    "export_main": "export.cli",
    "infer_main": "export.infer",
    "read_bundle": "export.bundle",
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
