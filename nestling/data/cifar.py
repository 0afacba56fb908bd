"""CIFAR-10/100 loading from torchvision's pickle folders, plain npz files or the shared WebP-packed npz."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np

from nestling.data.bundle import RawSplits
from nestling.data.safe_pickle import load_numpy_pickle
from nestling.data.webp_npz import cached_webp_decode
from nestling.errors import DataError

DATA_ROOT_ENV = "NESTLING_DATA_ROOT"  # consulted when load_dataset gets no root for a file-backed set

CIFAR10_CLASSES = [
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
]  # fmt: skip

# Fine labels in the standard (alphabetical) order used by the dataset and torchvision.
# fmt: off
CIFAR100_CLASSES = [
    "apple", "aquarium_fish", "baby", "bear", "beaver", "bed", "bee", "beetle", "bicycle", "bottle",
    "bowl", "boy", "bridge", "bus", "butterfly", "camel", "can", "castle", "caterpillar", "cattle",
    "chair", "chimpanzee", "clock", "cloud", "cockroach", "couch", "crab", "crocodile", "cup",
    "dinosaur", "dolphin", "elephant", "flatfish", "forest", "fox", "girl", "hamster", "house",
    "kangaroo", "keyboard", "lamp", "lawn_mower", "leopard", "lion", "lizard", "lobster", "man",
    "maple_tree", "motorcycle", "mountain", "mouse", "mushroom", "oak_tree", "orange", "orchid",
    "otter", "palm_tree", "pear", "pickup_truck", "pine_tree", "plain", "plate", "poppy", "porcupine",
    "possum", "rabbit", "raccoon", "ray", "road", "rocket", "rose", "sea", "seal", "shark", "shrew",
    "skunk", "skyscraper", "snail", "snake", "spider", "squirrel", "streetcar", "sunflower",
    "sweet_pepper", "table", "tank", "telephone", "television", "tiger", "tractor", "train", "trout",
    "tulip", "turtle", "wardrobe", "whale", "willow_tree", "wolf", "woman", "worm",
]
# fmt: on

_VARIANTS = {
    # name: (classes, torchvision folder, train pickles, test pickle, label key)
    "cifar10": (
        CIFAR10_CLASSES,
        "cifar-10-batches-py",
        [f"data_batch_{i}" for i in range(1, 6)],
        "test_batch",
        "labels",
    ),
    "cifar100": (CIFAR100_CLASSES, "cifar-100-python", ["train"], "test", "fine_labels"),
}


def _read_pickle_batch(path: Path, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise DataError(f"{path}: missing CIFAR batch file")
    batch = load_numpy_pickle(path)
    if not isinstance(batch, dict):
        raise DataError(f"{path}: expected a pickled dict, got {type(batch).__name__}")
    batch = {key.decode("latin1") if isinstance(key, bytes) else key: value for key, value in batch.items()}
    data, labels = batch.get("data"), batch.get(label_key)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise DataError(f"{path}: 'data' must be a uint8 array (N, 3072)")
    if labels is None or len(labels) != len(data):
        raise DataError(f"{path}: '{label_key}' missing or not one label per image")
    try:
        label_array = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError) as err:
        raise DataError(f"{path}: '{label_key}' are not integers ({err})") from err
    return data.reshape(-1, 3, 32, 32), label_array


def _read_pickle_layout(folder: Path, variant: str) -> tuple[np.ndarray, ...]:
    _, _, train_files, test_file, label_key = _VARIANTS[variant]
    train = [_read_pickle_batch(folder / name, label_key) for name in train_files]
    test_x, test_y = _read_pickle_batch(folder / test_file, label_key)
    return np.concatenate([x for x, _ in train]), np.concatenate([y for _, y in train]), test_x, test_y


def _read_npz_split(path: Path, cache_dir: Path | None) -> tuple[np.ndarray, np.ndarray]:
    """A plain (`x` uint8 N,32,32,3 + `y`) or WebP-packed split, returned as NCHW uint8 + int64 labels."""
    try:
        with np.load(path) as archive:
            keys = set(archive.files)
            if {"x", "y"} <= keys:
                images, labels = archive["x"], archive["y"]
            elif "x_webp" in keys:
                images = labels = None
            else:
                raise DataError(f"{path}: npz needs keys x,y or x_webp,offsets,shape,y (has {sorted(keys)})")
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise DataError(f"{path}: not a readable npz ({err})") from err
    if images is None:
        images, labels = cached_webp_decode(path, cache_dir)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != (32, 32, 3):
        raise DataError(f"{path}: 'x' must be uint8 (N,32,32,3), got {images.dtype} {images.shape}")
    if labels.ndim != 1 or len(labels) != len(images) or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(
            f"{path}: 'y' must hold one integer label per image, got {labels.dtype} {labels.shape}"
        )
    return images.transpose(0, 3, 1, 2), labels.astype(np.int64)


def _locate(variant: str, root: Path) -> tuple[str, Path]:
    """Find which of the accepted layouts `root` holds; the folder may also be the parent of `cifar10/`."""
    pickle_folder = _VARIANTS[variant][1]
    first_train = _VARIANTS[variant][2][0]
    for base in (root, root / variant):
        if (base / pickle_folder / first_train).is_file():
            return "pickle", base / pickle_folder
        if base.name == pickle_folder and (base / first_train).is_file():
            return "pickle", base
        if (base / "train.npz").is_file() and (base / "test.npz").is_file():
            return "npz", base
    raise DataError(
        f"{root}: no {variant} found; expected {pickle_folder}/{first_train}..., or train.npz + test.npz "
        f"(plain x/y or WebP-packed), directly or in {root / variant}"
    )


def load_cifar(variant: str, root: str | Path | None, cache_dir: str | Path | None = None) -> RawSplits:
    """CIFAR-10 or CIFAR-100 (Krizhevsky 2009) as uint8 NCHW arrays from any of the accepted layouts."""
    if variant not in _VARIANTS:
        raise DataError(f"unknown CIFAR variant {variant!r} (known: {', '.join(_VARIANTS)})")
    if root is None:
        if not os.environ.get(DATA_ROOT_ENV):
            raise DataError(
                f'{variant} needs its data folder: --data-root DIR on the command line, root = "DIR" under '
                f"[data] in a config file, or ${DATA_ROOT_ENV}"
            )
        root = os.environ[DATA_ROOT_ENV]
    folder = Path(root).expanduser()
    if not folder.is_dir():
        raise DataError(f"{folder}: {variant} root folder does not exist")
    layout, found = _locate(variant, folder)
    if layout == "pickle":
        train_x, train_y, test_x, test_y = _read_pickle_layout(found, variant)
    else:
        cache = Path(cache_dir) if cache_dir is not None else None
        train_x, train_y = _read_npz_split(found / "train.npz", cache)
        test_x, test_y = _read_npz_split(found / "test.npz", cache)
    classes = _VARIANTS[variant][0]
    return RawSplits(train_x, train_y, test_x, test_y, len(classes), list(classes), augment="cifar")
