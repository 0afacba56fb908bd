"""agent.toml: broker, device identity and budget, where the board's data comes from, and agent timings."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nestling.edge.export_settings import ExportSection
from nestling.errors import ConfigError
from nestling.wire.broker_settings import BrokerSettings, read_table, read_toml
from nestling.wire.topics import validate_id


@dataclass
class DeviceSection:
    id: str = ""
    memory_budget_mb: float | None = (
        None  # what training may use on this board; the server picks the submodel
    )
    torch_device: str = "cpu"  # "cuda" on a Jetson
    threads: int = 1  # torch intra-op threads (more than the cores collapses throughput)
    # Emulate a slower board (a loopback fleet replaying a trace): a catalogue class, or one trace device.
    emulate: str | None = None  # "rpi4", "phone-low", ... (simulator/catalogue.py)
    emulate_trace: str | None = None  # a trace file (relative to this file) ...
    emulate_device: str | None = None  # ... and the device_id whose figures to take
    # Where the procedures' per-device state (m-FeDepth's auxiliary models, FedDyn's h_k) survives an agent
    # restart or a power cut, relative to this file; unset: it lives in memory only.
    state_file: str | None = None
    # The board measures the fleet's model on first start (edge/self_profile.py) and caches the result in
    # its state folder (state_dir, else the state_file's folder, else state/ beside agent.toml).
    profile: bool = True
    profile_margin: float = 0.2  # share of the available memory training must leave free
    profile_repeats: int = 3
    state_dir: str | None = None
    # Emulation only: [[first_round, end_round, factor], ...] trains `factor` times slower in those rounds.
    emulate_slowdown: list[list[float]] = field(default_factory=list)


@dataclass
class DataSection:
    """The demo's data source: the board builds its own partition of a named dataset (same seed everywhere)."""

    dataset: str = "digits"
    root: str | None = None
    client_index: int = 0
    num_clients: int = 1
    seed: int = 0
    partition: str = "iid"
    alpha: float = 0.5
    limit_train: int | None = None


@dataclass
class AgentSection:
    heartbeat_s: float = 5.0
    chunk_kb: int = 256
    max_message_mb: int = 128
    stall_s: float = 1.0  # re-request missing task chunks after this long without one


@dataclass
class AgentConfig:
    broker: BrokerSettings = field(default_factory=BrokerSettings)
    device: DeviceSection = field(default_factory=DeviceSection)
    data: DataSection = field(default_factory=DataSection)
    agent: AgentSection = field(default_factory=AgentSection)
    export: ExportSection = field(default_factory=ExportSection)  # end-of-run export on this board
    path: Path | None = None


def agent_config_from_dict(data: dict[str, Any], base: Path = Path(".")) -> AgentConfig:
    unknown = sorted(set(data) - {"broker", "device", "data", "agent", "export"})
    if unknown:
        raise ConfigError(
            f"unknown agent config sections {unknown} (known: broker, device, data, agent, export)"
        )
    broker_table = data.get("broker", {})
    if not isinstance(broker_table, dict):
        raise ConfigError("[broker] must be a table")
    if isinstance(data.get("device"), dict) and "tier" in data["device"]:
        raise ConfigError(
            "[device] tier: a board no longer picks its own tier; pin it on the server, in fleet.toml "
            "[enrolment] tiers (or the enrolment file's [tiers])"
        )
    config = AgentConfig(
        broker=BrokerSettings.from_table(broker_table, base),
        device=read_table(DeviceSection, "device", data.get("device", {})),
        data=read_table(DataSection, "data", data.get("data", {})),
        agent=read_table(AgentSection, "agent", data.get("agent", {})),
        export=read_table(ExportSection, "export", data.get("export", {})).resolve(base),
    )
    config.export.check()
    validate_id(config.device.id, "[device] id")
    if config.data.root is not None:
        config.data.root = str(base / config.data.root)  # relative to the config file (absolute stays)
    if config.device.state_file is not None:
        config.device.state_file = str(base / config.device.state_file)
    if config.device.state_dir is not None:
        config.device.state_dir = str(base / config.device.state_dir)
    if config.device.emulate_trace is not None:
        config.device.emulate_trace = str(base / config.device.emulate_trace)
    d, a = config.data, config.agent
    checks = [
        (
            config.device.memory_budget_mb is None or config.device.memory_budget_mb > 0,
            "[device] memory_budget_mb must be > 0",
        ),
        (config.device.threads >= 1, "[device] threads must be >= 1"),
        (0.0 <= config.device.profile_margin < 0.95, "[device] profile_margin must lie in [0, 0.95)"),
        (1 <= config.device.profile_repeats <= 100, "[device] profile_repeats must lie in [1, 100]"),
        (
            all(
                isinstance(w, list)
                and len(w) == 3
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in w)
                and 0 <= w[0] < w[1]
                and w[2] > 0
                for w in config.device.emulate_slowdown
            ),
            "[device] emulate_slowdown must be a list of [first_round, end_round, factor > 0]",
        ),
        (
            config.device.emulate is None or config.device.emulate_trace is None,
            "[device] emulate (a board class) and emulate_trace (a trace device) exclude each other",
        ),
        (
            (config.device.emulate_trace is None) == (config.device.emulate_device is None),
            "[device] emulate_trace and emulate_device go together (the trace file and the device_id in it)",
        ),
        (
            d.num_clients >= 1 and 0 <= d.client_index < d.num_clients,
            "[data] needs 0 <= client_index < num_clients",
        ),
        (a.heartbeat_s > 0 and a.stall_s > 0, "[agent] heartbeat_s and stall_s must be > 0"),
        (a.chunk_kb >= 1 and a.max_message_mb >= 1, "[agent] chunk_kb and max_message_mb must be >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    return config


def state_dir(config: AgentConfig) -> Path:
    """Where the board keeps its state (the measured profile): state_dir, the state_file's folder, `state/`
    beside agent.toml, or (a config built in code) a per-fleet, per-device folder under ~/.cache/nestling."""
    device = config.device
    if device.state_dir is not None:
        return Path(device.state_dir)
    if device.state_file is not None:
        return Path(device.state_file).parent
    if config.path is not None:
        return config.path.parent / "state"
    return Path.home() / ".cache" / "nestling" / config.broker.fleet / device.id


def load_agent_config(path: Path) -> AgentConfig:
    """Read agent.toml; errors name the file and the key."""
    path = Path(path)
    data = read_toml(path, "agent config")
    config = agent_config_from_dict(data, path.parent.resolve())
    config.path = path.resolve()
    return config
