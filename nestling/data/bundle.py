"""In-memory dataset containers and the one path that turns raw pixel arrays into normalised tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from nestling.data.augment import AUGMENT_KINDS
from nestling.errors import DataError


@dataclass
class TensorData:
    """One split held as tensors, so a training batch is plain indexing (`x[idx]`), no loader workers."""

    x: torch.Tensor  # float32 (N, C, H, W), already normalised by the bundle's mean/std
    y: torch.Tensor  # int64 (N,)

    def __post_init__(self) -> None:
        if self.x.dim() != 4 or self.x.dtype != torch.float32:
            raise DataError(
                f"TensorData.x must be float32 (N,C,H,W), got {self.x.dtype} {tuple(self.x.shape)}"
            )
        if self.y.dim() != 1 or self.y.dtype != torch.int64:
            raise DataError(f"TensorData.y must be int64 (N,), got {self.y.dtype} {tuple(self.y.shape)}")
        if len(self.x) != len(self.y):
            raise DataError(f"TensorData has {len(self.x)} images but {len(self.y)} labels")

    def __len__(self) -> int:
        return len(self.y)


@dataclass
class DatasetBundle:
    """Everything a run needs to know about one dataset: both splits plus the facts models are built from."""

    name: str
    train: TensorData
    test: TensorData
    num_classes: int
    input_shape: tuple[int, int, int]  # (C, H, W)
    mean: tuple[float, ...]
    std: tuple[float, ...]
    class_names: list[str] = field(default_factory=list)
    augment: str = "none"


@dataclass
class RawSplits:
    """A loader's output before normalisation: NCHW arrays, uint8 (0..255 -> [0,1]) or float32 (used as is)."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int
    class_names: list[str]
    augment: str


def stratified_sample(labels: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """Pick `count` indices keeping each class's share (largest-remainder rounding), sorted ascending."""
    labels = np.asarray(labels)
    if not 0 < count <= len(labels):
        raise DataError(f"cannot take a stratified subset of {count} from {len(labels)} samples")
    classes, class_sizes = np.unique(labels, return_counts=True)
    exact = class_sizes * (count / len(labels))
    take = np.floor(exact).astype(np.int64)
    shortfall = count - int(take.sum())
    if shortfall:
        take[np.argsort(-(exact - take), kind="stable")[:shortfall]] += 1
    chosen = [
        rng.choice(np.flatnonzero(labels == cls), size=int(k), replace=False)
        for cls, k in zip(classes, take)
        if k
    ]
    return np.sort(np.concatenate(chosen))


def _pixel_scale(x: np.ndarray) -> float:
    if x.dtype == np.uint8:
        return 255.0
    if x.dtype == np.float32:
        return 1.0
    raise DataError(f"raw images must be uint8 or float32, got {x.dtype}")


def channel_stats(x: np.ndarray, chunk: int = 2048) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean/std (uint8 read as [0,1]), summed in float64 chunks so memory stays small."""
    scale = _pixel_scale(x)
    channels = x.shape[1]
    total = np.zeros(channels)
    total_sq = np.zeros(channels)
    for start in range(0, len(x), chunk):
        block = x[start : start + chunk].astype(np.float64) / scale
        total += block.sum(axis=(0, 2, 3))
        total_sq += np.square(block).sum(axis=(0, 2, 3))
    count = len(x) * x.shape[2] * x.shape[3]
    mean = total / count
    std = np.sqrt(np.maximum(total_sq / count - mean**2, 0.0))
    if np.any(std <= 0):
        raise DataError(
            f"a channel of the training images is constant (std {std.tolist()}); cannot normalise"
        )
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


def _to_tensor_data(
    x: np.ndarray, y: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]
) -> TensorData:
    scale = _pixel_scale(x)
    images = torch.from_numpy(np.ascontiguousarray(x)).to(torch.float32)
    mean_t = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1) * scale
    std_t = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1) * scale
    images.sub_(mean_t).div_(std_t)  # in place: the float copy is the only full-size allocation
    return TensorData(images, torch.from_numpy(np.asarray(y, dtype=np.int64).copy()))


def _check_raw(raw: RawSplits, name: str) -> None:
    for split, x, y in (("train", raw.train_x, raw.train_y), ("test", raw.test_x, raw.test_y)):
        if x.ndim != 4 or len(x) != len(y) or len(x) == 0:
            raise DataError(
                f"{name} {split}: expected N>0 images (N,C,H,W) with N labels, got {x.shape} / {y.shape}"
            )
        if y.min() < 0 or y.max() >= raw.num_classes:
            raise DataError(
                f"{name} {split}: labels span {int(y.min())}..{int(y.max())}, outside 0..{raw.num_classes - 1}"
            )
    if raw.train_x.shape[1:] != raw.test_x.shape[1:]:
        raise DataError(
            f"{name}: train images {raw.train_x.shape[1:]} differ from test {raw.test_x.shape[1:]}"
        )
    if raw.augment not in AUGMENT_KINDS:
        raise DataError(f"{name}: unknown augmentation {raw.augment!r} (known: {', '.join(AUGMENT_KINDS)})")


def finish_bundle(
    name: str, raw: RawSplits, seed: int, limit_train: int | None = None, limit_test: int | None = None
) -> DatasetBundle:
    """Normalise by the full training split's statistics, then apply the optional seeded stratified limits.

    Statistics come from the whole training split so a limited benchmark run sees exactly the same
    input scaling as a full one.
    """
    _check_raw(raw, name)
    mean, std = channel_stats(raw.train_x)
    rng = np.random.default_rng(seed)
    train_x, train_y, test_x, test_y = raw.train_x, raw.train_y, raw.test_x, raw.test_y
    if limit_train is not None and limit_train < len(train_y):
        keep = stratified_sample(train_y, limit_train, rng)
        train_x, train_y = train_x[keep], train_y[keep]
    if limit_test is not None and limit_test < len(test_y):
        keep = stratified_sample(test_y, limit_test, rng)
        test_x, test_y = test_x[keep], test_y[keep]
    channels, height, width = (int(d) for d in train_x.shape[1:])
    return DatasetBundle(
        name=name,
        train=_to_tensor_data(train_x, train_y, mean, std),
        test=_to_tensor_data(test_x, test_y, mean, std),
        num_classes=raw.num_classes,
        input_shape=(channels, height, width),
        mean=mean,
        std=std,
        class_names=list(raw.class_names),
        augment=raw.augment,
    )
