"""Discovery of a package's modules, so each extension point is one module that registers itself on import.

Families (nestling/models/zoo.py imports family_*.py), strategies (server/strategies) and local procedures
(edge/procedures) are found the same way: the package imports its own modules and each module registers what it
defines with its registry's decorator (`@register_family`, `@register_strategy`, `@register_procedure`). A
plugin's module (nestling.plugins) registers with the same decorators from outside the package.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable


def import_modules(package: str, path: Iterable[str], prefix: str = "") -> list[str]:
    """Import every module of `package` (found on its `__path__`) whose name starts with `prefix`, in name order;
    the names imported. A module that fails to import raises: a broken built-in is not silently left out."""
    names = sorted(m.name for m in pkgutil.iter_modules(list(path)) if m.name.startswith(prefix))
    for name in names:
        importlib.import_module(f"{package}.{name}")
    return names
