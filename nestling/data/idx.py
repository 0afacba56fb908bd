"""IDX (MNIST-family) file parsing and the Fashion-MNIST loader built on it."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from nestling.data.bundle import RawSplits
from nestling.errors import DataError

DEFAULT_FASHION_MNIST_ROOT = Path("/usr/share/datasets/fashion-mnist")  # Debian's dataset-fashion-mnist

FASHION_MNIST_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]  # fmt: skip

# IDX type byte -> big-endian numpy dtype (format as published with the MNIST database)
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def parse_idx(payload: bytes, source: str = "<bytes>") -> np.ndarray:
    """Decode one IDX blob: magic 0x0000, a type byte, a rank byte, big-endian uint32 dims, then data."""
    if len(payload) < 4 or payload[0] != 0 or payload[1] != 0:
        raise DataError(f"{source}: not an IDX file (magic number must start with two zero bytes)")
    type_code, rank = payload[2], payload[3]
    if type_code not in _IDX_DTYPES:
        raise DataError(f"{source}: unknown IDX element type 0x{type_code:02x}")
    header_end = 4 + 4 * rank
    if rank == 0 or len(payload) < header_end:
        raise DataError(f"{source}: IDX header truncated or rank {rank} invalid")
    dims = tuple(int(d) for d in np.frombuffer(payload, dtype=">u4", count=rank, offset=4))
    dtype = np.dtype(_IDX_DTYPES[type_code])
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(payload) - header_end != expected:
        raise DataError(
            f"{source}: IDX dims {dims} need {expected} data bytes, file has {len(payload) - header_end}"
        )
    return (
        np.frombuffer(payload, dtype=dtype, offset=header_end).reshape(dims).astype(dtype.newbyteorder("="))
    )


def read_idx_file(path: Path) -> np.ndarray:
    """Read an IDX file, gunzipping when the name ends in .gz."""
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        raise DataError(f"{path}: cannot read IDX file ({err})") from err
    return parse_idx(raw, str(path))


def _find_idx(root: Path, stem: str) -> Path:
    for candidate in (root / f"{stem}.gz", root / stem):
        if candidate.is_file():
            return candidate
    raise DataError(f"{root}: missing {stem}.gz (or uncompressed {stem})")


def _read_split(root: Path, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    images = read_idx_file(_find_idx(root, f"{prefix}-images-idx3-ubyte"))
    labels = read_idx_file(_find_idx(root, f"{prefix}-labels-idx1-ubyte"))
    if images.ndim != 3 or images.dtype != np.uint8:
        raise DataError(f"{root}: {prefix} images must be uint8 (N,H,W), got {images.dtype} {images.shape}")
    if labels.ndim != 1 or len(labels) != len(images):
        raise DataError(f"{root}: {prefix} has {len(images)} images but labels of shape {labels.shape}")
    return images[:, None, :, :], labels.astype(np.int64)


def load_fashion_mnist(root: str | Path | None) -> RawSplits:
    """Fashion-MNIST (Xiao et al. 2017) from IDX files; by default where Debian's package installs them."""
    folder = Path(root) if root is not None else DEFAULT_FASHION_MNIST_ROOT
    if not folder.is_dir():
        raise DataError(
            f"{folder}: Fashion-MNIST folder not found (expected train-images-idx3-ubyte.gz etc.; "
            "`apt-get install dataset-fashion-mnist` puts them in /usr/share/datasets/fashion-mnist)"
        )
    train_x, train_y = _read_split(folder, "train")
    test_x, test_y = _read_split(folder, "t10k")
    return RawSplits(train_x, train_y, test_x, test_y, 10, list(FASHION_MNIST_CLASSES), augment="none")
