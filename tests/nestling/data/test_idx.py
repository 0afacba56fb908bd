"""IDX parsing and the Fashion-MNIST loader, on files written here and (if installed) Debian's real ones."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from nestling.data import load_dataset
from nestling.data.idx import DEFAULT_FASHION_MNIST_ROOT, parse_idx, read_idx_file
from nestling.errors import DataError


def idx_bytes(array: np.ndarray) -> bytes:
    """Encode an array as IDX: two zero bytes, type byte, rank, big-endian dims, big-endian data."""
    type_code = {np.dtype(np.uint8): 0x08, np.dtype(np.int32): 0x0C, np.dtype(np.float32): 0x0D}[array.dtype]
    header = bytes([0, 0, type_code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_fashion(folder: Path, n_train: int, n_test: int, compress: bool) -> None:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, count in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(count, 28, 28), dtype=np.uint8)
        labels = (np.arange(count) % 10).astype(np.uint8)
        for stem, array in ((f"{prefix}-images-idx3-ubyte", images), (f"{prefix}-labels-idx1-ubyte", labels)):
            payload = idx_bytes(array)
            if compress:
                (folder / f"{stem}.gz").write_bytes(gzip.compress(payload))
            else:
                (folder / stem).write_bytes(payload)


def test_parse_idx_round_trips_several_types() -> None:
    for array in (
        np.arange(24, dtype=np.uint8).reshape(2, 3, 4),
        np.array([-5, 7, 1 << 20], dtype=np.int32),
        np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2),
    ):
        decoded = parse_idx(idx_bytes(array))
        assert decoded.shape == array.shape and np.array_equal(decoded, array)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\x01\x00\x08\x01\x00\x00\x00\x02ab", "magic number"),
        (b"\x00\x00\x42\x01\x00\x00\x00\x02ab", "unknown IDX element type 0x42"),
        (b"\x00\x00\x08\x03\x00\x00", "header truncated"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x05abc", r"need 5 data bytes, file has 3"),
    ],
)
def test_parse_idx_rejects_malformed_files(payload: bytes, message: str) -> None:
    with pytest.raises(DataError, match=message):
        parse_idx(payload, "bad.idx")


def test_read_idx_file_reports_broken_gzip(tmp_path: Path) -> None:
    broken = tmp_path / "x-idx1-ubyte.gz"
    broken.write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=r"cannot read IDX file"):
        read_idx_file(broken)


@pytest.mark.parametrize("compress", [True, False])
def test_fashion_mnist_loads_gz_and_plain_idx(tmp_path: Path, compress: bool) -> None:
    write_fashion(tmp_path, n_train=50, n_test=20, compress=compress)
    bundle = load_dataset("fashion-mnist", tmp_path)
    assert bundle.input_shape == (1, 28, 28) and bundle.num_classes == 10
    assert len(bundle.train) == 50 and len(bundle.test) == 20
    assert bundle.class_names[9] == "Ankle boot"
    assert bundle.train.y.tolist()[:12] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]


def test_fashion_mnist_missing_label_file_is_named(tmp_path: Path) -> None:
    write_fashion(tmp_path, n_train=10, n_test=10, compress=True)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match=r"missing t10k-labels-idx1-ubyte.gz"):
        load_dataset("fashion-mnist", tmp_path)


@pytest.mark.skipif(
    not DEFAULT_FASHION_MNIST_ROOT.is_dir(), reason="apt package dataset-fashion-mnist not installed"
)
def test_debian_fashion_mnist_has_published_statistics() -> None:
    bundle = load_dataset("fashion-mnist", limit_train=1000, limit_test=500)
    assert bundle.mean[0] == pytest.approx(0.2860, abs=1e-4) and bundle.std[0] == pytest.approx(
        0.3530, abs=1e-4
    )
    assert np.bincount(bundle.train.y.numpy()).tolist() == [100] * 10
