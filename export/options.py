"""What an export is told (ExportOptions) and given (ExportData: calibration and held-out images)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from nestling.data import DatasetBundle, load_dataset, stratified_sample
from nestling.errors import ConfigError
from nestling.export.onnx_export import DEFAULT_OPSET
from nestling.export.quantize import Int8Options
from nestling.export.tensorrt_build import TensorRTConfig

FORMATS = ("onnx", "tensorrt")


@dataclass
class ExportOptions:
    """Everything `nestling export` can be told; defaults give a checked fp32 ONNX bundle with latencies."""

    format: str = "onnx"
    exit: str | int | None = None
    all_exits: bool = False
    quantize: str | None = None  # "int8"
    opset: int = DEFAULT_OPSET
    simplify: bool | None = None  # None: when onnxsim is installed
    dynamo: bool = False
    align_channels: int = (
        8  # zero-pad feature maps to this multiple (export/align.py); 1 = off; conv models only
    )
    calib_samples: int = 1024
    eval_samples: int | None = 2000  # held-out images for accuracy (None: the whole test split)
    parity_samples: int = 64
    parity_tolerance: float = 1e-4  # max error relative to the logits' scale before a bundle is refused
    benchmark: bool = True
    threads: int = 1
    bench_rounds: int = 5
    bench_per_round: int = 20
    int8: Int8Options = field(default_factory=Int8Options)
    tensorrt: TensorRTConfig = field(default_factory=TensorRTConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError(f"[export] unknown format '{self.format}' (known: {', '.join(FORMATS)})")
        if self.align_channels < 1:
            raise ConfigError(f"[export] align_channels must be >= 1, got {self.align_channels}")
        if self.quantize not in (None, "int8"):
            raise ConfigError(f"[export] unknown quantization '{self.quantize}' (known: int8)")


@dataclass
class ExportData:
    """Real images for an export, normalised as in training: calibration from the training split, the
    held-out set (accuracy, real-input parity) from the test split, so int8 is never scored on its
    own calibration images."""

    name: str
    calibration: torch.Tensor
    heldout_x: torch.Tensor
    heldout_y: torch.Tensor
    mean: tuple[float, ...]
    std: tuple[float, ...]
    class_names: list[str]

    @classmethod
    def from_dataset(
        cls,
        bundle: DatasetBundle,
        *,
        calib_samples: int = 1024,
        eval_samples: int | None = 2000,
        seed: int = 0,
    ) -> ExportData:
        rng = np.random.default_rng(seed)
        train_y, test_y = bundle.train.y.numpy(), bundle.test.y.numpy()
        calib = stratified_sample(train_y, min(calib_samples, len(train_y)), rng)
        if eval_samples is None or eval_samples >= len(test_y):
            held = np.arange(len(test_y))
        else:
            held = stratified_sample(test_y, eval_samples, rng)
        return cls(
            bundle.name,
            bundle.train.x[calib],
            bundle.test.x[held],
            bundle.test.y[held],
            tuple(bundle.mean),
            tuple(bundle.std),
            list(bundle.class_names),
        )


def load_export_data(
    dataset: str | DatasetBundle,
    data_root: str | Path | None = None,
    *,
    calib_samples: int = 1024,
    eval_samples: int | None = 2000,
    seed: int = 0,
) -> ExportData:
    """ExportData from a dataset name (loaded with `nestling.data.load_dataset`) or a loaded bundle."""
    bundle = dataset if isinstance(dataset, DatasetBundle) else load_dataset(dataset, data_root, seed=seed)
    return ExportData.from_dataset(bundle, calib_samples=calib_samples, eval_samples=eval_samples, seed=seed)
