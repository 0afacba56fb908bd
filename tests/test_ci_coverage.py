"""In CI, what `scripts/setup.sh --dev` installs is really there, so no shipped feature's test quietly skips.

Locally a missing broker or dataset skips its tests with a reason; under CI (the `CI` variable set, as
`.ci/run` is started) a missing piece is a failure instead.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not os.environ.get("CI"), reason="checks the CI machine's setup (CI is not set)"
)


def test_the_ray_backend_is_installed() -> None:
    assert importlib.util.find_spec("ray") is not None, "setup.sh --dev installs the [ray] extra"


def test_the_mosquitto_broker_is_installed() -> None:
    assert shutil.which("mosquitto") is not None, "setup.sh --dev installs Debian's mosquitto"


def test_fashion_mnist_is_installed() -> None:
    assert Path("/usr/share/datasets/fashion-mnist").is_dir(), "setup.sh --dev installs dataset-fashion-mnist"
