"""fleet.toml: broker, fleet policy ([fleet]) and the run itself ([run] [data] [model] [method] [train], as in simulate)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nestling.config import SimConfig, config_from_dict
from nestling.errors import ConfigError
from nestling.server.enrolment import Enrolment, enrolment_from_table
from nestling.wire.broker_settings import BrokerSettings, read_table, read_toml

# A fleet loses devices mid-round, so its defaults differ from a simulation's (see docs/deploy.md).
RUN_DEFAULTS: dict[str, Any] = {"over_selection": 1.3, "quorum": 0.6, "deadline_s": 300.0, "eval_every": 1}
SERVER_DATA_KEYS = ("dataset", "root", "limit_test")  # the server only holds an evaluation set


@dataclass
class FleetSection:
    devices: int = 1  # fleet size: the participation fraction and the NeFL tiers by index refer to it
    min_devices: int = 0  # registrations to wait for before round 0 (0: all `devices`)
    round_min_devices: int = 1  # a round waits (up to registration_timeout_s) for this many available devices
    registration_timeout_s: float = 600.0
    heartbeat_timeout_s: float = 30.0  # no heartbeat for this long (and no last will): the device is gone
    chunk_kb: int = 256
    max_message_mb: int = 128
    stall_s: float = 1.0  # re-request a result's missing chunks after this long without one


EXPORT_MODES = ("off", "requested", "all")


@dataclass
class ExportPolicy:
    """[export]: after the last round, send boards the final weights of their submodel to build deployables."""

    on_finish: str = (
        "off"  # "requested": boards whose agent.toml sets [export] on_finish; "all": every online board
    )
    timeout_s: float = (
        600.0  # how long the server waits for the boards' export reports (TensorRT builds take minutes)
    )


@dataclass
class FleetConfig:
    broker: BrokerSettings
    fleet: FleetSection
    run: SimConfig  # validated by nestling.config exactly like `nestling simulate`'s
    out_dir: Path
    enrolment: Enrolment  # who may join, at which index and tier ([enrolment]; server/enrolment.py)
    export: ExportPolicy = field(default_factory=ExportPolicy)

    @property
    def min_devices(self) -> int:
        return self.fleet.min_devices or self.fleet.devices

    def to_dict(self) -> dict[str, Any]:
        """What summary.json records (no secrets: the broker password is left out)."""
        return {
            **self.run.to_dict(),
            "fleet": vars(self.fleet),
            "export": vars(self.export),
            "enrolment": self.enrolment.to_dict(),
            "broker": {"url": self.broker.url, "fleet": self.broker.fleet},
        }


SECTIONS = ("broker", "fleet", "enrolment", "run", "data", "model", "method", "train", "export")


def _enrolment(
    data: dict[str, Any], base: Path, fleet: FleetSection, name: str, open_enrolment: bool
) -> Enrolment:
    """[enrolment], required: the fleet's devices, or an explicit open door. Sets [fleet] devices when omitted."""
    fleet_table = data.get("fleet", {})
    enrolment = enrolment_from_table(
        data.get("enrolment", {}),
        base,
        fleet=name,
        seats=fleet.devices if "devices" in fleet_table else None,
        open_enrolment=open_enrolment,
    )
    if enrolment is None:
        raise ConfigError(
            "fleet.toml has no [enrolment]: list the fleet's devices (devices = [...], or file = the "
            "enrolment.toml `nestling broker-config` wrote), or let any device in with open = true "
            "(or nestling server --open-enrolment)"
        )
    if enrolment.open and enrolment.capacity is None:
        enrolment.capacity = fleet.devices
    if not enrolment.open:
        if "devices" not in fleet_table:
            fleet.devices = len(enrolment.devices)
        elif fleet.devices != len(enrolment.devices):
            raise ConfigError(
                f"[fleet] devices = {fleet.devices} but the enrolment ({enrolment.source}) lists "
                f"{len(enrolment.devices)}: drop [fleet] devices (the enrolment sets it) or enrol the rest"
            )
    return enrolment


def fleet_config_from_dict(
    data: dict[str, Any], base: Path = Path("."), *, open_enrolment: bool = False
) -> FleetConfig:
    """A fleet.toml's tables, checked; `open_enrolment` is `nestling server --open-enrolment`."""
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"unknown fleet config sections {unknown} (known: {', '.join(SECTIONS)})")
    if "allowed_devices" in data.get("fleet", {}):
        raise ConfigError("[fleet] allowed_devices is now [enrolment] devices (their order sets the indices)")
    broker = BrokerSettings.from_table(data.get("broker", {}), base)
    fleet = read_table(FleetSection, "fleet", data.get("fleet", {}))
    if fleet.devices < 1 or fleet.min_devices < 0 or fleet.round_min_devices < 1:
        raise ConfigError("[fleet] devices and round_min_devices must be >= 1, min_devices >= 0")
    if fleet.chunk_kb < 1 or fleet.max_message_mb < 1 or fleet.stall_s <= 0 or fleet.heartbeat_timeout_s <= 0:
        raise ConfigError("[fleet] chunk_kb, max_message_mb, stall_s and heartbeat_timeout_s must be > 0")
    enrolment = _enrolment(data, base, fleet, broker.fleet, open_enrolment)
    export = read_table(ExportPolicy, "export", data.get("export", {}))
    if export.on_finish not in EXPORT_MODES or export.timeout_s <= 0:
        raise ConfigError(f"[export] on_finish must be one of {', '.join(EXPORT_MODES)} and timeout_s > 0")
    run = dict(data.get("run", {}))
    out_dir = run.pop("out_dir", "runs/fleet")
    if "workers" in run:
        raise ConfigError("[run] workers is a simulation setting; a fleet's devices train themselves")
    data_table = dict(data.get("data", {}))
    if isinstance(data_table.get("root"), str):
        data_table["root"] = str(base / data_table["root"])  # relative to the config file (absolute stays)
    stray = sorted(set(data_table) - set(SERVER_DATA_KEYS))
    if stray:
        raise ConfigError(
            f"[data] {stray} belong in each agent.toml; the server's [data] is its evaluation set "
            f"({', '.join(SERVER_DATA_KEYS)})"
        )
    sim = config_from_dict(
        {
            "run": {**RUN_DEFAULTS, **run, "workers": 1},
            "data": {**data_table, "clients": fleet.devices},
            "model": data.get("model", {}),
            "method": data.get("method", {}),
            "train": data.get("train", {}),
        }
    )
    if sim.run.deadline_s is None or sim.run.deadline_s <= 0:
        raise ConfigError("[run] deadline_s must be > 0: a fleet round cannot wait forever for a lost device")
    if not isinstance(out_dir, str):
        raise ConfigError("[run] out_dir must be a string")
    return FleetConfig(broker, fleet, sim, (base / out_dir).resolve(), enrolment, export)


def load_fleet_config(path: Path, *, open_enrolment: bool = False) -> FleetConfig:
    """Read fleet.toml; relative paths (out_dir, credentials, enrolment file) are taken from the file's folder."""
    return fleet_config_from_dict(
        read_toml(Path(path), "fleet config"), Path(path).resolve().parent, open_enrolment=open_enrolment
    )
