"""The methods' own knowledge, shared by server and board: one subpackage per method that needs one.

Exit heads (ScaleFL, DepthFL, FeDepth), FedTrans's growth and DynamicFL's re-parameterisation live here, above
the kernel and below every layer that builds models. Importing this package imports every subpackage, so each
registers what it brings (its exit head under the name checkpoints carry) — adding one is one folder; server,
edge, export, profiler and simulator import it before they build a model.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path


def _import_method_packages() -> list[str]:
    """Import every subpackage of nestling/methods/ (in name order); the names imported."""
    names = sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if m.ispkg)
    for name in names:
        importlib.import_module(f"{__name__}.{name}")
    return names


METHOD_PACKAGES = tuple(_import_method_packages())
