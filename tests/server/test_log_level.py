"""`nestling server --log-level` and `nestling agent --log-level` take effect after the top-level CLI has
configured logging (basicConfig alone would be a no-op the second time)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from nestling.edge.agent_cli import agent_main
from nestling.server.fleet import server_main


@pytest.fixture
def configured_root():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    logging.basicConfig(level=logging.WARNING, force=True)  # what nestling/cli.py does first
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("main", [server_main, agent_main])
def test_log_level_overrides_the_cli_default(configured_root, tmp_path: Path, main) -> None:
    assert main(["--config", str(tmp_path / "missing.toml"), "--log-level", "DEBUG"]) == 2
    assert configured_root.level == logging.DEBUG
