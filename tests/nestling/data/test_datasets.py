"""load_dataset: the bundled digits, generated synthetic blobs, option checking and stratified limits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nestling.data import DatasetBundle, describe_bundle, load_dataset, stratified_sample
from nestling.errors import ConfigError, DataError


def test_digits_loads_offline_with_ten_classes_at_16x16() -> None:
    bundle = load_dataset("digits")
    assert isinstance(bundle, DatasetBundle)
    assert bundle.num_classes == 10 and bundle.class_names == [str(d) for d in range(10)]
    assert bundle.input_shape == (1, 16, 16)
    assert len(bundle.train) + len(bundle.test) == 1797
    assert len(bundle.test) == 359  # 20% of 1797, rounded
    assert bundle.train.x.shape == (len(bundle.train), 1, 16, 16) and bundle.train.x.dtype == torch.float32
    assert bundle.train.y.dtype == torch.int64 and bundle.test.y.dtype == torch.int64
    assert bundle.augment == "none"
    # normalised by the training split's own statistics
    assert abs(bundle.train.x.mean().item()) < 1e-4
    assert abs(bundle.train.x.std().item() - 1.0) < 1e-3
    assert "digits: 1438 train / 359 test, 1x16x16" in describe_bundle(bundle)


def test_digits_read_from_scikit_learns_csv_are_exactly_what_load_digits_returns(monkeypatch) -> None:
    from sklearn.datasets import load_digits

    from nestling.data import datasets

    images, targets = datasets._digits_arrays()
    reference = load_digits()
    assert np.array_equal(images, reference.images) and np.array_equal(targets, reference.target)
    assert images.dtype == reference.images.dtype and targets.dtype == np.int64
    # where this scikit-learn keeps the file elsewhere, its own loader is used: the same arrays
    monkeypatch.setattr(datasets.Path, "is_file", lambda self: False)
    again, again_targets = datasets._digits_arrays()
    assert np.array_equal(again, images) and np.array_equal(again_targets, targets)


def test_digits_split_is_stratified_seeded_and_disjoint() -> None:
    first, again, other = (
        load_dataset("digits", seed=3),
        load_dataset("digits", seed=3),
        load_dataset("digits", seed=4),
    )
    assert torch.equal(first.test.x, again.test.x) and torch.equal(first.train.y, again.train.y)
    assert not torch.equal(first.test.x, other.test.x)
    test_counts = np.bincount(first.test.y.numpy(), minlength=10)
    assert test_counts.min() >= 35 and test_counts.max() <= 37  # ~20% of each ~180-image class
    train_rows = {row.numpy().tobytes() for row in first.train.x}
    assert not any(row.numpy().tobytes() in train_rows for row in first.test.x[:50])


def test_synthetic_follows_its_options_and_seed() -> None:
    bundle = load_dataset("synthetic", seed=5, num_classes=4, channels=2, size=12, n_train=80, n_test=40)
    assert bundle.input_shape == (2, 12, 12) and bundle.num_classes == 4
    assert bundle.train.x.shape == (80, 2, 12, 12) and len(bundle.test) == 40
    assert np.bincount(bundle.train.y.numpy()).tolist() == [20, 20, 20, 20]
    same = load_dataset("synthetic", seed=5, num_classes=4, channels=2, size=12, n_train=80, n_test=40)
    other = load_dataset("synthetic", seed=6, num_classes=4, channels=2, size=12, n_train=80, n_test=40)
    assert torch.equal(bundle.train.x, same.train.x)
    assert not torch.equal(bundle.train.x, other.train.x)


def test_synthetic_is_learnable_by_a_small_cnn() -> None:
    torch.manual_seed(0)
    bundle = load_dataset("synthetic", seed=0, n_train=1000, n_test=300)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(64, 10),
    )  # fmt: skip
    optimiser = torch.optim.Adam(model.parameters(), lr=0.01)
    batches = torch.Generator().manual_seed(0)
    for _ in range(150):
        idx = torch.randint(0, len(bundle.train), (64,), generator=batches)
        loss = torch.nn.functional.cross_entropy(model(bundle.train.x[idx]), bundle.train.y[idx])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    with torch.no_grad():
        accuracy = (model(bundle.test.x).argmax(1) == bundle.test.y).float().mean().item()
    assert accuracy > 0.9


def test_limits_take_seeded_stratified_subsets_with_full_split_statistics() -> None:
    full = load_dataset("synthetic", seed=1, n_train=400, n_test=200)
    limited = load_dataset("synthetic", seed=1, n_train=400, n_test=200, limit_train=100, limit_test=50)
    assert len(limited.train) == 100 and len(limited.test) == 50
    assert np.bincount(limited.train.y.numpy()).tolist() == [10] * 10
    assert limited.mean == full.mean and limited.std == full.std
    # every limited image is one of the full split's images, normalised identically
    full_rows = {row.numpy().tobytes() for row in full.train.x}
    assert all(row.numpy().tobytes() in full_rows for row in limited.train.x)


def test_stratified_sample_keeps_class_shares() -> None:
    labels = np.repeat(np.arange(3), [50, 30, 20])
    picked = stratified_sample(labels, 10, np.random.default_rng(0))
    assert np.bincount(labels[picked]).tolist() == [5, 3, 2]
    assert len(np.unique(picked)) == 10


def test_unknown_dataset_lists_the_known_ones() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown dataset 'mnist2'.*digits.*synthetic.*fashion-mnist.*cifar10"
    ):
        load_dataset("mnist2")


def test_unknown_option_and_bad_limit_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"digits does not take size"):
        load_dataset("digits", size=32)
    with pytest.raises(ConfigError, match=r"limit_train must be a positive integer"):
        load_dataset("digits", limit_train=0)
    with pytest.raises(ConfigError, match=r"synthetic needs"):
        load_dataset("synthetic", num_classes=1)


def test_file_backed_sets_without_root_name_what_is_missing(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("NESTLING_DATA_ROOT", raising=False)
    with pytest.raises(DataError, match=r"cifar10 needs its data folder: --data-root DIR"):
        load_dataset("cifar10")
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match=str(missing)):
        load_dataset("cifar100", missing)
    with pytest.raises(DataError, match=r"Fashion-MNIST folder not found"):
        load_dataset("fashion-mnist", missing)
