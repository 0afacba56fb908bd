"""CIFAR loading in all accepted layouts, the restricted unpickler, and the WebP decode cache."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from nestling.data import load_dataset
from nestling.data.cifar import CIFAR100_CLASSES, load_cifar
from nestling.data.safe_pickle import load_numpy_pickle
from nestling.data.webp_npz import cached_webp_decode
from nestling.errors import DataError

# The shared data folder beside the repository (or $NESTLING_DATA_ROOT); tests that read it skip without it.
SHARED_CIFAR10_TEST = (
    Path(os.environ.get("NESTLING_DATA_ROOT", Path(__file__).resolve().parents[4] / "shared" / "data"))
    / "cifar10"
    / "test.npz"
)


def to_rows(x: np.ndarray) -> np.ndarray:
    """NHWC images as CIFAR's pickles store them: one row of 3072 bytes per image, channel-major."""
    return x.transpose(0, 3, 1, 2).reshape(len(x), -1)


def write_torchvision_cifar10(root: Path, data: dict[str, np.ndarray], protocol: int) -> None:
    """torchvision's layout: five train batches + test_batch, each a pickled dict of numpy arrays."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    train_chunks = np.array_split(np.arange(len(data["train_y"])), 5)
    for number, chunk in enumerate(train_chunks, start=1):
        batch = {b"data": to_rows(data["train_x"][chunk]), b"labels": data["train_y"][chunk].tolist()}
        (folder / f"data_batch_{number}").write_bytes(pickle.dumps(batch, protocol=protocol))
    test = {b"data": to_rows(data["test_x"]), b"labels": data["test_y"].tolist(), b"batch_label": b"test"}
    (folder / "test_batch").write_bytes(pickle.dumps(test, protocol=protocol))


def write_webp_npz(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    """The shared folder's format: lossless WebP images back to back, cut by offsets."""
    blobs = []
    for image in x:
        out = io.BytesIO()
        Image.fromarray(image).save(out, format="WEBP", lossless=True)
        blobs.append(np.frombuffer(out.getvalue(), np.uint8))
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in blobs])]).astype(np.int64)
    np.savez(
        path, x_webp=np.concatenate(blobs), offsets=offsets, shape=np.array(x.shape), y=y.astype(np.int64)
    )


def assert_matches(bundle, data: dict[str, np.ndarray]) -> None:
    """The bundle holds the source pixels in source order, normalised by the bundle's mean/std."""
    assert bundle.input_shape == (3, 32, 32) and bundle.augment == "cifar"
    assert bundle.train.y.tolist() == data["train_y"].tolist()
    mean = torch.tensor(bundle.mean).view(1, 3, 1, 1)
    std = torch.tensor(bundle.std).view(1, 3, 1, 1)
    restored = (bundle.test.x * std + mean) * 255
    expected = torch.from_numpy(data["test_x"]).permute(0, 3, 1, 2).float()
    assert torch.allclose(restored, expected, atol=1e-3)


@pytest.mark.parametrize("protocol", [2, 5])
def test_torchvision_pickle_layout(tmp_path: Path, tiny_cifar, protocol: int) -> None:
    write_torchvision_cifar10(tmp_path, tiny_cifar, protocol)
    bundle = load_dataset("cifar10", tmp_path)
    assert bundle.num_classes == 10 and bundle.class_names[0] == "airplane"
    assert len(bundle.train) == 60 and len(bundle.test) == 20
    assert_matches(bundle, tiny_cifar)


def test_torchvision_cifar100_layout(tmp_path: Path, tiny_cifar) -> None:
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for name, x, y in (
        ("train", tiny_cifar["train_x"], tiny_cifar["train_y"]),
        ("test", tiny_cifar["test_x"], tiny_cifar["test_y"]),
    ):
        batch = {"data": to_rows(x), "fine_labels": (y * 9).tolist(), "coarse_labels": (y % 20).tolist()}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=4))
    bundle = load_dataset("cifar100", folder)  # root may also be the pickle folder itself
    assert bundle.num_classes == 100 and len(bundle.class_names) == 100
    assert sorted(CIFAR100_CLASSES) == CIFAR100_CLASSES and CIFAR100_CLASSES[-1] == "worm"
    assert sorted(set(bundle.train.y.tolist())) == [9 * k for k in range(10)]


def test_plain_npz_layout_under_a_parent_folder(tmp_path: Path, tiny_cifar) -> None:
    folder = tmp_path / "cifar10"
    folder.mkdir()
    np.savez(folder / "train.npz", x=tiny_cifar["train_x"], y=tiny_cifar["train_y"])
    np.savez(folder / "test.npz", x=tiny_cifar["test_x"], y=tiny_cifar["test_y"])
    assert_matches(load_dataset("cifar10", tmp_path), tiny_cifar)  # parent of cifar10/
    assert_matches(load_dataset("cifar10", folder), tiny_cifar)


def test_webp_npz_layout_decodes_once_into_the_cache(tmp_path: Path, tiny_cifar) -> None:
    source, cache = tmp_path / "src", tmp_path / "cache"
    source.mkdir()
    write_webp_npz(source / "train.npz", tiny_cifar["train_x"], tiny_cifar["train_y"])
    write_webp_npz(source / "test.npz", tiny_cifar["test_x"], tiny_cifar["test_y"])
    assert_matches(load_dataset("cifar10", source, cache_dir=cache), tiny_cifar)

    digest = hashlib.sha256((source / "test.npz").read_bytes()).hexdigest()
    cached = cache / "webp-decoded" / f"{digest}.npz"
    assert cached.is_file()
    # Prove the second load reads the cache, not the WebP: plant a marker pixel in the cached copy.
    with np.load(cached) as plain:
        x, y = plain["x"].copy(), plain["y"]
    x[0, 0, 0, 0] = 255 - x[0, 0, 0, 0]
    np.savez(cached, x=x, y=y)
    again, _ = cached_webp_decode(source / "test.npz", cache)
    assert again[0, 0, 0, 0] == x[0, 0, 0, 0]


def test_missing_files_and_bad_arrays_are_data_errors(tmp_path: Path, tiny_cifar) -> None:
    with pytest.raises(DataError, match=r"no cifar10 found; expected cifar-10-batches-py/data_batch_1"):
        load_cifar("cifar10", tmp_path)
    write_torchvision_cifar10(tmp_path, tiny_cifar, protocol=4)
    (tmp_path / "cifar-10-batches-py" / "data_batch_4").unlink()
    with pytest.raises(DataError, match=r"data_batch_4: missing CIFAR batch file"):
        load_cifar("cifar10", tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    np.savez(bad / "train.npz", x=np.zeros((4, 28, 28), np.uint8), y=np.zeros(4, np.int64))
    np.savez(bad / "test.npz", x=np.zeros((4, 28, 28), np.uint8), y=np.zeros(4, np.int64))
    with pytest.raises(DataError, match=r"'x' must be uint8 \(N,32,32,3\)"):
        load_cifar("cifar10", bad)
    np.savez(bad / "train.npz", x=tiny_cifar["train_x"], y=tiny_cifar["train_y"] + 10)
    np.savez(bad / "test.npz", x=tiny_cifar["test_x"], y=tiny_cifar["test_y"])
    with pytest.raises(DataError, match=r"labels span 10..19, outside 0..9"):
        load_dataset("cifar10", bad)


class _RunsShell:
    """A pickle payload that would run a shell command when loaded by an unrestricted unpickler."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_and_never_runs(tmp_path: Path, tiny_cifar) -> None:
    write_torchvision_cifar10(tmp_path, tiny_cifar, protocol=2)
    marker = tmp_path / "pwned"
    batch = {b"data": _RunsShell(marker), b"labels": [0]}
    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_bytes(pickle.dumps(batch))
    with pytest.raises(DataError, match=r"refused to unpickle .*(posix|os)\.system"):
        load_dataset("cifar10", tmp_path)
    assert not marker.exists()


def test_restricted_unpickler_refuses_builtins_and_array_subclasses(tmp_path: Path) -> None:
    evil = tmp_path / "evil"
    evil.write_bytes(b"cbuiltins\neval\n(S'1+1'\ntR.")  # protocol 0: call builtins.eval("1+1")
    with pytest.raises(DataError, match=r"refused to unpickle"):
        load_numpy_pickle(evil)
    subclass = tmp_path / "subclass"
    subclass.write_bytes(pickle.dumps(np.ma.masked_array([1, 2]), protocol=2))
    with pytest.raises(DataError, match=r"not allowed"):
        load_numpy_pickle(subclass)
    plain = tmp_path / "plain"
    plain.write_bytes(pickle.dumps({"a": np.arange(5, dtype=np.int16), "b": [1, "x"]}, protocol=5))
    loaded = load_numpy_pickle(plain)
    assert (
        loaded["a"].dtype == np.int16 and loaded["a"].tolist() == [0, 1, 2, 3, 4] and loaded["b"] == [1, "x"]
    )


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_CIFAR10_TEST.is_file(), reason="shared CIFAR-10 data not present")
def test_shared_webp_cifar10_test_split_decodes_exactly(tmp_path: Path) -> None:
    images, labels = cached_webp_decode(SHARED_CIFAR10_TEST, tmp_path)
    assert images.shape == (10_000, 32, 32, 3) and images.dtype == np.uint8
    assert np.bincount(labels).tolist() == [1000] * 10
    # digests published in the shared data README for the decoded arrays
    assert hashlib.sha256(images.tobytes()).hexdigest().startswith("2e7763586d54b5ac")
    assert hashlib.sha256(labels.astype(np.int64).tobytes()).hexdigest().startswith("888a4b10891ac78d")
