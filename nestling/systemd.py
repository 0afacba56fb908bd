"""systemd units for Nestling's long-running commands (the board agent, the fleet server).

One writer for both, so the policies that keep a fleet up (restart on failure, start after the network,
one torch thread, a clean SIGTERM) are stated once.
"""

from __future__ import annotations

import getpass
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServiceSpec:
    """What differs between Nestling's services: the unit's name, its description and the module it runs."""

    unit_name: str
    description: str
    module: str
    extra_args: tuple[str, ...] = ()
    nice: int = 0


def unit_text(
    service: ServiceSpec,
    config: Path,
    *,
    python: str = sys.executable,
    user: str | None = None,
    working_dir: Path | None = None,
) -> str:
    """The unit file's text: restart on failure, one torch thread, start after the network is up."""
    config = Path(config).resolve()
    user = user or getpass.getuser()
    command = " ".join(
        shlex.quote(part)
        for part in (python, "-m", service.module, *service.extra_args, "--config", str(config))
    )
    return "\n".join(
        [
            "[Unit]",
            f"Description={service.description}",
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
            # SIGTERM makes the process publish 'offline' and disconnect before it exits.
            "KillSignal=SIGTERM",
            "TimeoutStopSec=20",
            *([f"Nice={service.nice}"] if service.nice else []),
            "",
            "[Install]",
            "WantedBy=multi-user.target",
            "",
        ]
    )


def write_unit(service: ServiceSpec, config: Path, out: Path, *, user: str | None = None) -> Path:
    """Write the unit to `out` (a file, or a directory that gets `service.unit_name`)."""
    out = Path(out)
    path = out / service.unit_name if out.is_dir() else out
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(unit_text(service, config, user=user))
    return path
