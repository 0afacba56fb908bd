"""The board's resource snapshot: what its heartbeat carries must pass the server's status schema."""

from __future__ import annotations

from nestling.edge.monitor import ResourceMonitor
from nestling.wire.schemas import status_resources


def test_a_boards_own_heartbeat_passes_the_servers_status_schema() -> None:
    """Every field the monitor reports is one the schema knows (an unknown one refuses every heartbeat)."""
    monitor = ResourceMonitor()
    snapshot = monitor.snapshot()
    assert {"cpu_percent", "available_memory_bytes", "rss_bytes", "peak_rss_bytes"} <= set(snapshot)
    assert status_resources(snapshot) == snapshot
