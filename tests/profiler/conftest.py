"""Fixtures of the profiler tests: FeDepth's PreResNet-20 configuration and a tiny spec for fast runs."""

from __future__ import annotations

import pytest

from nestling.models.config import ModelConfig
from nestling.spec import SubmodelSpec


@pytest.fixture
def preresnet20() -> ModelConfig:
    """FeDepth's PreResNet-20 with batch statistics (METHODS §1.5, §3.a.9)."""
    return ModelConfig("preresnet20", norm_stats="batch")


@pytest.fixture
def tiny_spec() -> SubmodelSpec:
    return SubmodelSpec(ModelConfig("tinycnn", image_size=8))
