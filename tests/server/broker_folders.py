"""Folders for generated broker configs that mosquitto's own account can enter.

Started as root, mosquitto drops to the `mosquitto` account, as Debian's service does; pytest's tmp folders are
0700 root, so a fleet config there would be unreadable for the reason the tests must not hide.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path


def broker_folder() -> Path:
    """A fresh folder under the system temp dir, enterable by other accounts (0711), removed at exit."""
    path = Path(tempfile.mkdtemp(prefix="nestling-broker-test-"))
    path.chmod(0o711)
    atexit.register(shutil.rmtree, path, True)
    return path
