"""The deployment bundle: model files plus `bundle.json`, every file pinned by its sha256.

Imported by `export.infer` on boards without PyTorch: this module needs only the standard library.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from nestling.errors import DataError
from nestling.hashing import sha256_file
from nestling.strict_json import strict_dumps

BUNDLE_FORMAT = 1
MANIFEST_NAME = "bundle.json"


def write_bundle(folder: Path, manifest: dict[str, Any], files: list[str]) -> Path:
    """Hash `files` (names inside `folder`) into manifest["files"] and write bundle.json atomically."""
    body = {
        **manifest,
        "format": BUNDLE_FORMAT,
        "files": {name: sha256_file(folder / name) for name in files},
    }
    target = folder / MANIFEST_NAME
    tmp = folder / f".{MANIFEST_NAME}.tmp-{os.getpid()}"
    tmp.write_text(strict_dumps(body, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, target)
    return target


def read_bundle(folder: Path, *, verify: bool = True) -> dict[str, Any]:
    """bundle.json of `folder`; with `verify`, refused unless every listed file matches its sha256."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        raise DataError(f"{folder} is not an export bundle: it has no {MANIFEST_NAME}")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DataError(f"{path} is not valid JSON: {exc}") from None
    if manifest.get("format") != BUNDLE_FORMAT:
        raise DataError(
            f"{path} has bundle format {manifest.get('format')!r}, this Nestling reads {BUNDLE_FORMAT}"
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise DataError(f"{path} lists no files with their sha256")
    referenced = {entry["file"] for entry in manifest.get("models", {}).values()}
    unlisted = sorted(referenced - set(files))
    if unlisted:
        raise DataError(f"{path} references {unlisted} without a sha256 for them")
    if verify:
        for name, expected in files.items():
            file = Path(folder) / name
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise DataError(f"{path} lists a file outside the bundle: {name}")
            if not file.is_file():
                raise DataError(f"bundle file {name} is missing from {folder}")
            actual = sha256_file(file)
            if actual != expected:
                raise DataError(
                    f"bundle file {name} does not match its sha256 (expected {expected[:12]}…, "
                    f"found {actual[:12]}…): refusing a modified or corrupt bundle"
                )
    return manifest
