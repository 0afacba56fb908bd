"""The methods layer: every subpackage is discovered on import, and every layer that builds models imports it."""

from __future__ import annotations

import ast
from pathlib import Path

import nestling.methods
from nestling.models.heads import registered_exit_heads

REPO = Path(__file__).resolve().parents[2]

# where a model gets built or folded: the package of each layer above the methods, and the export modules that
# meet a model (`nestling.export` itself stays importable without PyTorch, for `nestling infer`)
BUILDERS = (
    "server/__init__.py",
    "edge/__init__.py",
    "profiler/__init__.py",
    "simulator/__init__.py",
    "export/standalone.py",
    "export/source.py",
    "export/reference.py",
)


def test_every_method_folder_is_imported_by_the_package() -> None:
    on_disk = sorted(p.parent.name for p in (REPO / "methods").glob("*/__init__.py"))
    assert list(nestling.methods.METHOD_PACKAGES) == on_disk
    assert {"dynamicfl", "fedtrans", "scalefl", "depthfl", "fedepth"} <= set(on_disk)
    assert {"scalefl", "depthfl", "fedepth"} <= set(registered_exit_heads())


def _imports_methods_at_module_level(path: Path) -> bool:
    tree = ast.parse(path.read_text(), filename=str(path))
    return any(
        isinstance(node, ast.Import) and any(alias.name == "nestling.methods" for alias in node.names)
        for node in tree.body
    )


def test_every_layer_that_builds_models_imports_the_methods_first() -> None:
    missing = [name for name in BUILDERS if not _imports_methods_at_module_level(REPO / name)]
    assert not missing, f"these build or fold models without registering the methods' exit heads: {missing}"
    assert not _imports_methods_at_module_level(REPO / "export" / "__init__.py")  # torch-free for infer
