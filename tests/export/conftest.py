"""Export fixtures: CIFAR-sized NeFL-WD and ScaleFL checkpoints with non-trivial BN statistics and steps."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from nestling.data import load_dataset
from nestling.export.pipeline import ExportData
from nestling.models.layers import SlimBatchNorm2d
from nestling.models.zoo import build
from nestling.server.checkpoint import save_strategy_checkpoint
from nestling.server.strategies import Strategy, StrategyContext, create_strategy

torch.set_num_threads(1)

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
CIFAR_TEST = (
    Path(os.environ.get("NESTLING_DATA_ROOT", Path(__file__).resolve().parents[3] / "shared" / "data"))
    / "cifar10"
    / "test.npz"
)


def _context(dataset: str = "cifar10") -> StrategyContext:
    return StrategyContext(
        arch="resnet20",
        num_classes=10,
        in_channels=3,
        image_size=32,
        num_clients=10,
        total_rounds=1,
        seed=0,
        dataset=dataset,
    )


def _randomise_bn(net: torch.nn.Module, generator: torch.Generator) -> None:
    """Give every BN an affine far from (1, 0) so a wrong fold cannot hide behind identity parameters."""
    for module in net.modules():
        if isinstance(module, SlimBatchNorm2d):
            module.weight.copy_(torch.rand(module.weight.shape, generator=generator) * 0.8 + 0.6)
            module.bias.copy_(torch.rand(module.bias.shape, generator=generator) * 0.4 - 0.2)


def save_strategy(strategy: Strategy, root: Path) -> Path:
    """Write the checkpoint the coordinator would write after round 0."""
    return save_strategy_checkpoint(root, 0, strategy, seed=0)


@pytest.fixture
def write_checkpoint() -> Callable[[Strategy, Path], Path]:
    return save_strategy


@torch.no_grad()
def make_nefl_checkpoint(root: Path) -> Path:
    """NeFL-WD ResNet-20: each submodel's own store gets its own BN statistics (one train-mode pass over
    random images), BN affine and step sizes, as after training."""
    strategy = create_strategy("nefl-wd", _context())
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(64, 3, 32, 32, generator=generator)
    for k, target in enumerate(strategy.eval_targets()):
        net = build(target.spec, init=False)
        net.load_state_dict(target.state)
        _randomise_bn(net, generator)
        for module in net.modules():
            if isinstance(module, SlimBatchNorm2d):
                module.reset_running_stats()
                module.momentum = None
        net.train()
        net(images)
        for name, parameter in net.named_parameters():
            if name.endswith("step"):
                parameter.copy_(torch.rand(1, generator=generator) * 0.8 + 0.6)
        state = net.state_dict()
        for key in strategy.stores[k]:
            strategy.stores[k][key] = state[key].clone()
    return save_strategy(strategy, root)


@torch.no_grad()
def make_scalefl_checkpoint(root: Path) -> Path:
    """ScaleFL ResNet-20 (batch-statistics BN, Scaler always on, exits): random affine on every BN."""
    strategy = create_strategy("scalefl", _context("synthetic"))
    net = build(strategy.full_spec, init=False)
    net.load_state_dict(strategy.global_state)
    _randomise_bn(net, torch.Generator().manual_seed(1))
    strategy.global_state.update({k: v.clone() for k, v in net.state_dict().items()})
    return save_strategy(strategy, root)


@pytest.fixture(scope="session")
def nefl_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_nefl_checkpoint(tmp_path_factory.mktemp("nefl") / "checkpoints")


@pytest.fixture(scope="session")
def scalefl_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scalefl_checkpoint(tmp_path_factory.mktemp("scalefl") / "checkpoints")


@pytest.fixture(scope="session")
def synthetic32() -> ExportData:
    """Real-shaped 32×32 RGB data (seeded blobs): calibration from train, parity/accuracy on test."""
    bundle = load_dataset("synthetic", size=32, n_train=256, n_test=128)
    return ExportData.from_dataset(bundle, calib_samples=256, eval_samples=128)


def cifar_test_pixels(count: int) -> tuple[np.ndarray, np.ndarray]:
    """The first `count` CIFAR-10 test images as uint8 (N, 32, 32, 3), decoded from the shared WebP npz."""
    if not CIFAR_TEST.is_file():
        pytest.skip(f"CIFAR-10 test split not found at {CIFAR_TEST}")
    from PIL import Image

    with np.load(CIFAR_TEST) as packed:
        blob, offsets, labels = packed["x_webp"], packed["offsets"], packed["y"][:count]
        pixels = np.stack(
            [
                np.asarray(Image.open(io.BytesIO(blob[offsets[i] : offsets[i + 1]].tobytes())).convert("RGB"))
                for i in range(count)
            ]
        )
    return pixels, labels


def normalise(pixels: np.ndarray) -> np.ndarray:
    """The bundle's input rule (export.infer): (pixels/255 − mean)/std, NCHW float32."""
    x = pixels.astype(np.float32).transpose(0, 3, 1, 2) / 255.0
    return (x - np.asarray(CIFAR_MEAN, np.float32).reshape(1, 3, 1, 1)) / np.asarray(
        CIFAR_STD, np.float32
    ).reshape(1, 3, 1, 1)


@pytest.fixture(scope="session")
def cifar100_images() -> tuple[np.ndarray, np.ndarray]:
    return cifar_test_pixels(100)


@pytest.fixture(scope="session")
def cifar_data(cifar100_images: tuple[np.ndarray, np.ndarray]) -> ExportData:
    """ExportData over 100 real CIFAR-10 test images with the usual CIFAR-10 normalisation."""
    pixels, labels = cifar100_images
    x = torch.from_numpy(normalise(pixels))
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    return ExportData(
        "cifar10", x, x, torch.from_numpy(labels.astype(np.int64)), CIFAR_MEAN, CIFAR_STD, names
    )
