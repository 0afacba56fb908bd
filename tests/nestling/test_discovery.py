"""nestling.discovery imports a package's modules in name order, so each registers what it defines."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nestling.discovery import import_modules


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "discovered_pkg"
    root.mkdir()
    (root / "__init__.py").write_text("ORDER = []\n")
    for name in ("family_b", "family_a", "helper"):
        (root / f"{name}.py").write_text(f"from discovered_pkg import ORDER\nORDER.append({name!r})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield root
    for name in [m for m in sys.modules if m.startswith("discovered_pkg")]:
        del sys.modules[name]


def test_modules_are_imported_in_name_order_and_a_prefix_selects_them(package: Path) -> None:
    import discovered_pkg  # type: ignore[import-not-found]

    assert import_modules("discovered_pkg", [str(package)], prefix="family_") == ["family_a", "family_b"]
    assert discovered_pkg.ORDER == ["family_a", "family_b"]
    assert import_modules("discovered_pkg", [str(package)]) == ["family_a", "family_b", "helper"]
    assert discovered_pkg.ORDER == ["family_a", "family_b", "helper"]  # a module is imported once


def test_a_module_that_fails_to_import_is_an_error_not_a_missing_entry(package: Path) -> None:
    (package / "broken.py").write_text("raise RuntimeError('broken module')\n")
    with pytest.raises(RuntimeError, match="broken module"):
        import_modules("discovered_pkg", [str(package)])
