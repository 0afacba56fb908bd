"""The deployment bundle: model files plus `bundle.json`, every file pinned by its sha256.

Imported by `export.infer` on boards without PyTorch: this module needs only the standard library and msgspec.
A bundle may come from a board: its manifest is checked against a schema (what `infer` reads, typed and bounded),
and a file that is a symbolic link, or lies outside the folder, is refused before any hashing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from nestling.errors import DataError
from nestling.hashing import sha256_file
from nestling.strict_json import strict_dumps

BUNDLE_FORMAT = 1
MANIFEST_NAME = "bundle.json"

_FileName = Annotated[str, Meta(min_length=1, max_length=255)]
_Dimension = Annotated[int, Meta(ge=1, le=65536)]


class _ModelFile(msgspec.Struct):
    file: _FileName


class _Normalization(msgspec.Struct):
    mean: Annotated[list[Annotated[float, Meta(ge=-1e6, le=1e6)]], Meta(min_length=1, max_length=64)]
    std: Annotated[list[Annotated[float, Meta(gt=0.0, le=1e6)]], Meta(min_length=1, max_length=64)]
    pixel_scale: Annotated[float, Meta(gt=0.0, le=1e9)] = 255.0


class _Input(msgspec.Struct):
    name: Annotated[str, Meta(min_length=1, max_length=128)]
    shape: tuple[Annotated[str, Meta(max_length=32)] | _Dimension, _Dimension, _Dimension, _Dimension]
    normalization: _Normalization | None = None


class _Manifest(msgspec.Struct):
    """What reading and running a bundle relies on; the rest of bundle.json is descriptive."""

    files: Annotated[dict[_FileName, Annotated[str, Meta(pattern="^[0-9a-f]{64}$")]], Meta(min_length=1)]
    models: Annotated[dict[Annotated[str, Meta(max_length=32)], _ModelFile], Meta(min_length=1)]
    default_model: str
    default_output: Annotated[str, Meta(min_length=1, max_length=128)]
    input: _Input
    class_names: Annotated[list[Annotated[str, Meta(max_length=256)]], Meta(max_length=1_000_000)] | None = (
        None
    )


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
    if path.is_symlink():
        raise DataError(f"{path} is a symbolic link: a bundle holds its own files")
    if not path.is_file():
        raise DataError(f"{folder} is not an export bundle: it has no {MANIFEST_NAME}")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, RecursionError) as exc:
        raise DataError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise DataError(f"{path} is not a bundle manifest: expected a JSON object")
    if manifest.get("format") != BUNDLE_FORMAT:
        raise DataError(
            f"{path} has bundle format {manifest.get('format')!r:.40}, this Nestling reads {BUNDLE_FORMAT}"
        )
    try:
        checked = msgspec.convert(manifest, _Manifest, strict=True)
    except msgspec.ValidationError as exc:
        raise DataError(f"{path} is malformed: {exc}") from None
    unlisted = sorted({entry.file for entry in checked.models.values()} - set(checked.files))
    if unlisted:
        raise DataError(f"{path} references {unlisted} without a sha256 for them")
    normalization, channels = checked.input.normalization, checked.input.shape[1]
    if normalization is not None and not len(normalization.mean) == len(normalization.std) in (1, channels):
        raise DataError(f"{path}: input normalization needs 1 or {channels} means and as many stds")
    if checked.default_model not in checked.models:
        raise DataError(f"{path} names default model {checked.default_model!r:.40}, which it does not list")
    if verify:
        root = Path(folder).resolve()
        for name, expected in checked.files.items():
            file = _inside(Path(folder), root, name, path)
            actual = sha256_file(file)
            if actual != expected:
                raise DataError(
                    f"bundle file {name} does not match its sha256 (expected {expected[:12]}…, "
                    f"found {actual[:12]}…): refusing a modified or corrupt bundle"
                )
    return manifest


def _inside(folder: Path, root: Path, name: str, manifest: Path) -> Path:
    """The bundle's regular file `name`; DataError for a path leaving the folder, a symbolic link, a missing file."""
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise DataError(f"{manifest} lists a file outside the bundle: {name}")
    file = folder / name
    step = folder
    for part in Path(name).parts:  # no link anywhere on the way: its target is not what was hashed at export
        step = step / part
        if step.is_symlink():
            raise DataError(f"bundle file {name} is a symbolic link ({step}): refusing it")
    if not file.is_file():
        raise DataError(f"bundle file {name} is missing from {folder}")
    if not file.resolve().is_relative_to(root):
        raise DataError(f"bundle file {name} resolves outside the bundle")
    return file
