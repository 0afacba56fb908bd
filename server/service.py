"""`nestling server install-service`: a systemd unit that keeps the coordinator running, resuming after a crash.

The unit runs `nestling server --resume`: after a crash or a reboot the server continues from its newest
complete checkpoint (and starts afresh when there is none yet).
"""

from __future__ import annotations

from pathlib import Path

from nestling import systemd

SERVER_SERVICE = systemd.ServiceSpec(
    unit_name="nestling-server.service",
    description="Nestling federated-learning server (fleet coordinator)",
    module="nestling.server.fleet",
    extra_args=("--resume",),
)
UNIT_NAME = SERVER_SERVICE.unit_name


def write_unit(config: Path, out: Path, *, user: str | None = None) -> Path:
    """Write the server's unit to `out` (a file, or a directory that gets nestling-server.service)."""
    return systemd.write_unit(SERVER_SERVICE, config, out, user=user)
