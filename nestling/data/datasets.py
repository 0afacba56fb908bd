"""`load_dataset`: one entry point for every dataset Nestling trains on, by name, returning tensors in memory."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from nestling.data.bundle import DatasetBundle, RawSplits, finish_bundle, stratified_sample
from nestling.data.cifar import load_cifar
from nestling.data.idx import load_fashion_mnist
from nestling.errors import ConfigError, DependencyError

DIGITS_SIDE = 16  # load_digits is 8x8; two stride-2 ResNet stages would leave 2x2, so upsample to 16x16
DIGITS_TEST_FRACTION = 0.2


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 8x8 images (values 0..16) and their labels, read from the CSV scikit-learn ships.

    Reading the file where scikit-learn keeps it takes 35 ms; `import sklearn` takes 1.3-3 s, and every process
    that trains on digits (each pool worker, each CLI command in the tests) paid it. The CSV holds 64 pixel
    columns then the label, as `sklearn.datasets.load_digits` reads it; when the file is not where this
    scikit-learn keeps it, that function is used."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise DependencyError(
            "[data] dataset 'digits' ships inside scikit-learn, which a board install leaves out: "
            "pip install scikit-learn (or 'nestling[workstation]'), or train on 'synthetic' or a "
            "file-backed dataset (fashion-mnist, cifar10, cifar100) under [data] root"
        )
    csv = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if csv.is_file():
        table = np.loadtxt(csv, delimiter=",")
        return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.images, digits.target.astype(np.int64)


def _load_digits(root: Path | None, seed: int) -> RawSplits:
    """scikit-learn's bundled UCI handwritten digits: works offline, no download, ~1800 real images.

    Bilinear upsampling to 16x16 keeps the CIFAR ResNets' stem and two stride-2 stages meaningful
    (8x8 would shrink to 2x2 before the last stage); it adds no information, only room.
    """
    images8, targets = _digits_arrays()
    pixels = torch.from_numpy(images8.astype(np.float32) / 16.0).unsqueeze(1)  # 0..16 -> [0, 1]
    pixels = F.interpolate(pixels, size=(DIGITS_SIDE, DIGITS_SIDE), mode="bilinear", align_corners=False)
    images, labels = pixels.numpy(), targets
    rng = np.random.default_rng(seed)
    test_idx = stratified_sample(labels, round(DIGITS_TEST_FRACTION * len(labels)), rng)
    train_mask = np.ones(len(labels), dtype=bool)
    train_mask[test_idx] = False
    names = [str(d) for d in range(10)]
    return RawSplits(
        images[train_mask], labels[train_mask], images[test_idx], labels[test_idx], 10, names, augment="none"
    )


def _load_synthetic(
    root: Path | None,
    seed: int,
    num_classes: int = 10,
    channels: int = 3,
    size: int = 16,
    n_train: int = 2000,
    n_test: int = 500,
    noise: float = 0.5,
    blobs_per_class: int = 2,
) -> RawSplits:
    """Seeded Gaussian-blob images: each class owns a few blobs (position, width, colour), plus pixel noise.

    Classes differ in where their blobs sit, so a small CNN separates them quickly; noise keeps it from
    being trivial. Train and test share the class prototypes.
    """
    if num_classes < 2 or channels < 1 or size < 4 or n_train < num_classes or n_test < 1:
        raise ConfigError(
            f"[data] synthetic needs num_classes>=2, channels>=1, size>=4, n_train>=num_classes, n_test>=1 "
            f"(got {num_classes}, {channels}, {size}, {n_train}, {n_test})"
        )
    if noise < 0 or blobs_per_class < 1:
        raise ConfigError(
            f"[data] synthetic needs noise>=0 and blobs_per_class>=1 (got {noise}, {blobs_per_class})"
        )
    rng = np.random.default_rng(seed)
    grid = np.arange(size, dtype=np.float64)
    centres = rng.uniform(0.15 * size, 0.85 * size, size=(num_classes, blobs_per_class, 2))
    widths = rng.uniform(0.08 * size, 0.18 * size, size=(num_classes, blobs_per_class))
    colours = rng.uniform(-1.0, 1.0, size=(num_classes, blobs_per_class, channels))
    rows = np.exp(-((grid[None, None, :] - centres[..., 0, None]) ** 2) / (2 * widths[..., None] ** 2))
    cols = np.exp(-((grid[None, None, :] - centres[..., 1, None]) ** 2) / (2 * widths[..., None] ** 2))
    blob_maps = rows[..., :, None] * cols[..., None, :]  # (K, B, H, W)
    prototypes = np.einsum("kbc,kbhw->kchw", colours, blob_maps)

    def draw(count: int) -> tuple[np.ndarray, np.ndarray]:
        labels = rng.permutation(np.arange(count) % num_classes).astype(np.int64)
        gain = rng.uniform(0.8, 1.2, size=(count, 1, 1, 1))
        images = prototypes[labels] * gain + rng.normal(0.0, noise, size=(count, channels, size, size))
        return images.astype(np.float32), labels

    train_x, train_y = draw(n_train)
    test_x, test_y = draw(n_test)
    names = [f"class_{k}" for k in range(num_classes)]
    return RawSplits(train_x, train_y, test_x, test_y, num_classes, names, augment="none")


def _load_fashion(root: Path | None, seed: int) -> RawSplits:
    return load_fashion_mnist(root)


def _load_cifar10(root: Path | None, seed: int, cache_dir: str | Path | None = None) -> RawSplits:
    return load_cifar("cifar10", root, cache_dir)


def _load_cifar100(root: Path | None, seed: int, cache_dir: str | Path | None = None) -> RawSplits:
    return load_cifar("cifar100", root, cache_dir)


_LOADERS: dict[str, tuple[Callable[..., RawSplits], tuple[str, ...]]] = {
    "digits": (_load_digits, ()),
    "synthetic": (
        _load_synthetic,
        ("num_classes", "channels", "size", "n_train", "n_test", "noise", "blobs_per_class"),
    ),
    "fashion-mnist": (_load_fashion, ()),
    "cifar10": (_load_cifar10, ("cache_dir",)),
    "cifar100": (_load_cifar100, ("cache_dir",)),
}
_ALIASES = {
    "fashion_mnist": "fashion-mnist",
    "fmnist": "fashion-mnist",
    "cifar-10": "cifar10",
    "cifar-100": "cifar100",
}
_COMMON_OPTS = ("limit_train", "limit_test")

KNOWN_DATASETS = tuple(_LOADERS)


def _check_limit(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"[data] {name} must be a positive integer, got {value!r}")
    return value


def load_dataset(name: str, root: str | Path | None = None, *, seed: int = 0, **opts: Any) -> DatasetBundle:
    """Load a dataset by name into memory, normalised, with seeded stratified `limit_train`/`limit_test`.

    `root` is used by the file-backed sets (fashion-mnist, cifar10, cifar100) and ignored by the
    generated or bundled ones (digits, synthetic). Per-dataset options: synthetic takes num_classes,
    channels, size, n_train, n_test, noise, blobs_per_class; CIFAR takes cache_dir (WebP decode cache).
    """
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in _LOADERS:
        raise ConfigError(f"[data] unknown dataset {name!r} (known: {', '.join(KNOWN_DATASETS)})")
    loader, own_opts = _LOADERS[key]
    unknown = sorted(set(opts) - set(own_opts) - set(_COMMON_OPTS))
    if unknown:
        allowed = ", ".join(own_opts + _COMMON_OPTS)
        raise ConfigError(f"[data] {key} does not take {', '.join(unknown)} (allowed: {allowed})")
    limit_train = _check_limit("limit_train", opts.pop("limit_train", None))
    limit_test = _check_limit("limit_test", opts.pop("limit_test", None))
    folder = Path(root).expanduser() if root is not None else None
    raw = loader(folder, seed, **opts)
    return finish_bundle(key, raw, seed, limit_train=limit_train, limit_test=limit_test)


def describe_bundle(bundle: DatasetBundle) -> str:
    """One line for logs: name, split sizes, input shape, classes."""
    c, h, w = bundle.input_shape
    return (
        f"{bundle.name}: {len(bundle.train)} train / {len(bundle.test)} test, {c}x{h}x{w}, "
        f"{bundle.num_classes} classes, augment={bundle.augment}"
    )


__all__ = ["KNOWN_DATASETS", "describe_bundle", "load_dataset"]
