"""What the server learns about this board: its hello (profile) and its retained status heartbeat."""

from __future__ import annotations

from typing import Any

from nestling.edge.agent_config import AgentConfig
from nestling.edge.agent_link import AgentLink
from nestling.edge.agent_profiling import AgentProfiling
from nestling.edge.emulation import EmulationTarget
from nestling.edge.monitor import ResourceMonitor
from nestling.edge.procedures import ClientData
from nestling.wire.fleet_messages import DeviceStatus, encode_hello, encode_status


class AgentPresence:
    """The board's state ("online", "training", "exporting") and round, said in every heartbeat."""

    def __init__(
        self,
        link: AgentLink,
        config: AgentConfig,
        data: ClientData,
        monitor: ResourceMonitor,
        profiling: AgentProfiling,
        emulation: EmulationTarget | None,
    ) -> None:
        self.link = link
        self.config = config
        self.data = data
        self.monitor = monitor
        self.profiling = profiling
        self.emulation = emulation
        self.device_id = config.device.id
        self.state = "online"
        self.round: int | None = None

    def profile(self) -> dict[str, Any]:
        device, data = self.config.device, self.config.data
        profile: dict[str, Any] = {
            "num_samples": len(self.data),
            "labels": sorted(set(self.data.y.tolist())),
            "index": data.client_index,
            "dataset": data.dataset,
            **self.monitor.profile(),
        }
        cap = self.profiling.memory_cap
        if device.memory_budget_mb is not None:  # a hand-set budget wins over what the board measured
            budget = int(device.memory_budget_mb * 1024 * 1024)
            profile["memory_budget_bytes"] = budget if cap is None else min(budget, cap)
        if device.profile:
            profile["profiling"] = self.profiling.profiling
        board = self.profiling.board_fields()
        if board:
            profile["board_profile"] = board
        export = self.config.export.advertised()
        if export is not None:  # asks the server for the final model of its submodel when the run ends
            profile["export"] = export
        if self.emulation is not None:  # the server logs it and lists it in summary.json
            profile["emulating"] = self.emulation.describe()
        return profile

    def hello(self) -> None:
        """Register (again): after a (re)connect, a new server session, a new profile or a rehello."""
        self.link.publish_hello(encode_hello(self.device_id, self.profile()))
        self.heartbeat()

    def heartbeat(self) -> None:
        status = DeviceStatus(self.device_id, self.state, self.round, self.monitor.snapshot())
        self.link.publish_status(encode_status(status))
