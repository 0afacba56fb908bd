"""`nestling agent install-service`: a systemd unit that keeps the agent running across crashes and reboots."""

from __future__ import annotations

import sys
from pathlib import Path

from nestling import systemd

AGENT_SERVICE = systemd.ServiceSpec(
    unit_name="nestling-agent.service",
    description="Nestling federated-learning agent",
    module="nestling.edge.agent_cli",
    nice=5,  # training yields to whatever else the board runs
)
UNIT_NAME = AGENT_SERVICE.unit_name


def unit_text(
    config: Path, *, python: str = sys.executable, user: str | None = None, working_dir: Path | None = None
) -> str:
    """The agent's unit file text (see nestling.systemd.unit_text)."""
    return systemd.unit_text(AGENT_SERVICE, config, python=python, user=user, working_dir=working_dir)


def write_unit(config: Path, out: Path, *, user: str | None = None) -> Path:
    """Write the agent's unit to `out` (a file, or a directory that gets nestling-agent.service)."""
    return systemd.write_unit(AGENT_SERVICE, config, out, user=user)
