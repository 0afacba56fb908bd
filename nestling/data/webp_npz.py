"""Decoding of the WebP-packed CIFAR npz files in the shared data folder, with a sha256-keyed plain-npz cache."""

from __future__ import annotations

import io
import logging
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from nestling.errors import DataError, DependencyError
from nestling.hashing import sha256_file

WEBP_KEYS = ("x_webp", "offsets", "shape", "y")

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """Where decoded splits are kept: $XDG_CACHE_HOME/nestling (usually ~/.cache/nestling)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nestling"


def decode_webp_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Decode every image of a WebP-packed split to uint8 (N,H,W,3); one Pillow call per image."""
    try:
        from PIL import Image
    except ImportError as err:
        raise DependencyError("decoding WebP-packed CIFAR needs Pillow (`pip install Pillow`)") from err
    try:
        with np.load(path) as packed:
            missing = [key for key in WEBP_KEYS if key not in packed.files]
            if missing:
                raise DataError(f"{path}: WebP npz lacks keys {missing} (has {packed.files})")
            buffer, offsets = packed["x_webp"], packed["offsets"].astype(np.int64)
            shape, labels = tuple(int(d) for d in packed["shape"]), packed["y"].astype(np.int64)
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise DataError(f"{path}: not a readable npz ({err})") from err
    if len(shape) != 4 or len(offsets) != shape[0] + 1 or len(labels) != shape[0]:
        raise DataError(f"{path}: shape {shape}, {len(offsets)} offsets and {len(labels)} labels disagree")
    if offsets[0] != 0 or offsets[-1] != len(buffer) or np.any(np.diff(offsets) <= 0):
        raise DataError(f"{path}: offsets do not cut x_webp ({len(buffer)} bytes) into non-empty images")
    images = np.empty(shape, np.uint8)
    for i in range(shape[0]):
        blob = buffer[offsets[i] : offsets[i + 1]].tobytes()
        try:
            decoded = np.asarray(Image.open(io.BytesIO(blob)).convert("RGB"))
        except (OSError, ValueError) as err:
            raise DataError(f"{path}: image {i} does not decode ({err})") from err
        if decoded.shape != shape[1:]:
            raise DataError(f"{path}: image {i} decodes to {decoded.shape}, expected {shape[1:]}")
        images[i] = decoded
    return images, labels


def cached_webp_decode(path: Path, cache_dir: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Decode once, then reuse: the plain npz is cached under the source file's sha256.

    The shared folder is read-only and a full decode takes 15-20 s, so the cache lives in the user's
    cache directory; keying by content (not path) keeps a changed source from hitting a stale entry.
    """
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cached = folder / "webp-decoded" / f"{sha256_file(path)}.npz"
    if cached.is_file():
        try:
            with np.load(cached) as plain:
                return plain["x"], plain["y"]
        except (OSError, ValueError, KeyError):
            cached.unlink(missing_ok=True)  # a torn or foreign file: decode again below
    images, labels = decode_webp_npz(path)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        fd, temp_name = tempfile.mkstemp(dir=cached.parent, suffix=".npz.tmp")
    except OSError as err:
        log.warning("cannot cache decoded %s in %s (%s); the next load decodes again", path, folder, err)
        return images, labels
    try:
        with os.fdopen(fd, "wb") as handle:
            np.savez(handle, x=images, y=labels)
        os.replace(temp_name, cached)  # atomic: a concurrent reader sees the whole file or none
    except OSError as err:
        Path(temp_name).unlink(missing_ok=True)
        log.warning("cannot cache decoded %s in %s (%s); the next load decodes again", path, folder, err)
    return images, labels
