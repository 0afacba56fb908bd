"""`nestling agent install-service`: a systemd unit that keeps the agent running across crashes and reboots."""

from __future__ import annotations

import getpass
import shlex
import sys
from pathlib import Path

UNIT_NAME = "nestling-agent.service"


def unit_text(config: Path, *, python: str = sys.executable, user: str | None = None,
              working_dir: Path | None = None) -> str:
    """The unit file's text: restart on failure, one torch thread, start after the network is up."""
    config = Path(config).resolve()
    user = user or getpass.getuser()
    command = " ".join(shlex.quote(part) for part in (python, "-m", "nestling.edge.agent_cli", "--config", str(config)))
    return "\n".join([
        "[Unit]",
        "Description=Nestling federated-learning agent",
        "Wants=network-online.target",
        "After=network-online.target",
        # Give up only after many quick failures (a wrong password should not spin forever).
        "StartLimitIntervalSec=600",
        "StartLimitBurst=20",
        "",
        "[Service]",
        "Type=simple",
        f"User={user}",
        f"WorkingDirectory={working_dir or config.parent}",
        "Environment=OMP_NUM_THREADS=1",
        "Environment=PYTHONUNBUFFERED=1",
        f"ExecStart={command}",
        "Restart=on-failure",
        "RestartSec=5",
        # SIGTERM makes the agent publish 'offline' and disconnect before it exits.
        "KillSignal=SIGTERM",
        "TimeoutStopSec=20",
        "Nice=5",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ])


def write_unit(config: Path, out: Path, *, user: str | None = None) -> Path:
    """Write the unit to `out` (a file, or a directory that gets nestling-agent.service)."""
    out = Path(out)
    path = out / UNIT_NAME if out.is_dir() else out
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(unit_text(config, user=user))
    return path
