"""Run configuration: a TOML file plus command-line overrides, validated into typed sections."""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from nestling.errors import ConfigError
from nestling.task_params import TrainParams

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover
    pass


@dataclass
class DataSection:
    dataset: str = "digits"
    root: str | None = None
    partition: str = "iid"
    alpha: float = 0.5
    classes_per_client: int = 2
    clients: int = 20
    limit_train: int | None = None
    limit_test: int | None = None
    augment: bool | None = None  # None: the dataset's default (CIFAR crop+flip)


@dataclass
class ModelSection:
    arch: str = "resnet20"
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class MethodSection:
    name: str = "nefl-wd"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainSection:
    fraction: float = 0.5
    local_epochs: int = 5  # NeFL's recipe (E = 5, B = 32, SGD lr 0.1, METHODS §2.c); a task's default is 1
    local_steps: int | None = None
    # The optimiser's and batching's defaults are the task records' (nestling.task_params: one place).
    batch_size: int = TrainParams.batch_size
    lr: float = TrainParams.lr
    schedule: str = "step"
    gamma: float = 0.1
    milestones: list[float] = field(default_factory=lambda: [0.5, 0.75])
    momentum: float = TrainParams.momentum
    weight_decay: float = TrainParams.weight_decay
    grad_clip: float | None = None
    precision: str = "fp32"  # fp32, or bf16: forward under autocast (CPUs with AMX/AVX-512 BF16, Jetson Orin)
    channels_last: bool = False  # NHWC weights and activations (oneDNN and cuDNN run convolutions faster)

    def local_hparams(self) -> dict[str, Any]:
        """What every task of a run carries for local training (strategies add their own on top)."""
        hp: dict[str, Any] = {
            "local_epochs": self.local_epochs,
            "batch_size": self.batch_size,
            "momentum": self.momentum,
            "weight_decay": self.weight_decay,
        }
        if self.local_steps is not None:
            hp["local_steps"] = self.local_steps
        if self.grad_clip is not None:
            hp["grad_clip"] = self.grad_clip
        if self.precision != "fp32":  # only when set, so fp32 tasks stay exactly as before
            hp["precision"] = self.precision
        if self.channels_last:
            hp["channels_last"] = True
        return hp


@dataclass
class RunSection:
    rounds: int = 15
    seed: int = 0
    device: str = "cpu"
    workers: int = 0  # 0: as many worker processes as cores (one torch thread each); 1: in-process
    eval_every: int = 5
    eval_batch: int = 512
    # Training images HeteroFL-style static BN is recalibrated on before each evaluation (0: all of them).
    # A seeded random subset of a few thousand estimates the statistics well at a fraction of the cost.
    calibration_samples: int = 0
    checkpoint_every: int = 1
    over_selection: float = 1.0
    quorum: float = 1.0
    deadline_s: float | None = None
    # Share of deadline_s a board's local training is planned for (profiler/fit.py sizes measured boards to
    # it; the rest is transfers and waiting): a generous deadline with a small share plans tight and waits long.
    train_share: float = 0.7
    traces: str | None = None  # device trace file: replay on a virtual clock (docs/simulator.md)
    # How far a replay's virtual clock moves for the server's own work between rounds (simulator/server_time.py):
    # none; fixed (server_round_s every round, + server_eval_s / server_checkpoint_s on rounds that evaluate /
    # write a checkpoint); measured (this process's own server work per round x server_time_factor).
    server_time: str = "none"
    server_round_s: float | None = None
    server_eval_s: float | None = None
    server_checkpoint_s: float | None = None
    server_time_factor: float | None = None
    # The fleet transport's own time inside a round (simulator/transport_time.py): none, or fixed: the server's
    # serial seconds per task (+ per MB of its tensors), a broker hop each way, seconds per MB of a result collected.
    transport_time: str = "none"
    transport_dispatch_s: float | None = None
    transport_dispatch_s_per_mb: float | None = None
    transport_hop_s: float | None = None
    transport_collect_s_per_mb: float | None = None
    backend: str = "auto"  # auto (pool when workers > 1), inprocess, pool, ray
    batching: str = "off"  # train same-spec clients of a round together: off, on, auto (only when faster)
    compile: bool = False  # torch.compile client models in the simulator's workers
    # Robustness against bad boards (server/screening.py): screening refuses non-finite updates, updates
    # above max_update_norm and updates whose rms is over update_norm_factor x the round's median.
    screen_updates: bool = True
    max_update_norm: float | None = None
    update_norm_factor: float = 10.0
    clip_update_norm: float | None = None  # DP-FedAvg style L2 bound: larger updates are scaled down
    aggregation: str = "mean"  # mean (each method's own), trimmed_mean or median (coordinate-wise)
    trim_fraction: float = 0.1
    divergence_guard: bool = True  # roll back a round that left the model non-finite or exploded
    divergence_factor: float = 1000.0
    quarantine_rounds: int = 3  # rounds the devices of a rolled-back round are not selected
    # A board the cohort screen refused in 2 of its last 3 judged rounds is not selected for this many rounds,
    # doubled each time it happens again (server/strikes.py; 0: never set aside).
    strike_rounds: int = 5
    # refuse an update whose cosine with the mean of the round's other updates is below this and an outlier
    # among the round's cosines (server/screening.py). -1 (the default): off, honest non-IID boards can point
    # against the others (issue 29); 0 suits IID fleets.
    min_update_cosine: float = -1.0
    # Bounded influence (server/influence.py): a result counts at most max_sample_factor x the fleet's median
    # registered sample count, and weighs at most max_weight_share of its round (0: no bound).
    max_sample_factor: float = 3.0
    max_weight_share: float = 0.3
    # How BN running statistics are aggregated: "median" per channel over the boards holding it (a board's
    # in-range lie moves it by one rank at most), or "mean", the papers' weighted mean (nestling/aggregation.py)
    bn_statistics: str = "median"
    # With "mean": BN running statistics against the cohort, channel by channel (server/statistics_cohort.py)
    bn_variance_factor: float = 4.0
    bn_mean_sigmas: float = 3.0
    # refuse an update far off the direction of its submodel's other updates in the round, in cohorts of 5+
    # (server/update_cohort.py); its cut sits below every honest IID and Dirichlet board measured
    cohort_screen: bool = True


BACKENDS = ("auto", "inprocess", "pool", "ray")
BATCHING = ("off", "on", "auto")
AGGREGATIONS = ("mean", "trimmed_mean", "median")  # [run] aggregation (nestling.aggregation.robust_rule)
STATISTICS_RULES = ("median", "mean")  # [run] bn_statistics (nestling.aggregation); the first is the default
PRECISIONS = ("fp32", "bf16")  # [train] precision: edge/execution.py applies it
SERVER_TIMES = ("none", "fixed", "measured")  # [run] server_time: simulator/server_time.py
FIXED_SERVER_TIMES = ("server_round_s", "server_eval_s", "server_checkpoint_s")
TRANSPORT_TIMES = ("none", "fixed")  # [run] transport_time: simulator/transport_time.py
TRANSPORT_TIME_KEYS = (
    "transport_dispatch_s",
    "transport_dispatch_s_per_mb",
    "transport_hop_s",
    "transport_collect_s_per_mb",
)


@dataclass
class SimConfig:
    run: RunSection = field(default_factory=RunSection)
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    method: MethodSection = field(default_factory=MethodSection)
    train: TrainSection = field(default_factory=TrainSection)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def validate(self) -> SimConfig:
        checks = [
            (self.run.rounds >= 1, "[run] rounds must be >= 1"),
            (self.data.clients >= 1, "[data] clients must be >= 1"),
            (0.0 < self.train.fraction <= 1.0, "[train] fraction must be in (0, 1]"),
            (self.train.local_epochs >= 1, "[train] local_epochs must be >= 1"),
            (self.train.batch_size >= 1, "[train] batch_size must be >= 1"),
            (0 < self.train.lr < math.inf, "[train] lr must be a finite number > 0"),
            (
                self.train.local_steps is None or self.train.local_steps >= 1,
                "[train] local_steps must be >= 1",
            ),
            (0 <= self.train.momentum < math.inf, "[train] momentum must be a finite number >= 0"),
            (0 <= self.train.weight_decay < math.inf, "[train] weight_decay must be a finite number >= 0"),
            (self.run.seed >= 0, "[run] seed must be >= 0"),
            (self.run.eval_every >= 0, "[run] eval_every must be >= 0 (0: only after the last round)"),
            (self.data.limit_train is None or self.data.limit_train >= 1, "[data] limit_train must be >= 1"),
            (self.data.limit_test is None or self.data.limit_test >= 1, "[data] limit_test must be >= 1"),
            (self.run.workers >= 0, "[run] workers must be >= 0"),
            (self.run.calibration_samples >= 0, "[run] calibration_samples must be >= 0 (0: all)"),
            (self.run.over_selection >= 1.0, "[run] over_selection must be >= 1"),
            (0.0 < self.run.quorum <= 1.0, "[run] quorum must be in (0, 1]"),
            (0.0 < self.run.train_share <= 1.0, "[run] train_share must be in (0, 1]"),
            (self.data.alpha > 0, "[data] alpha must be > 0"),
            (self.run.backend in BACKENDS, f"[run] backend must be one of {', '.join(BACKENDS)}"),
            (self.run.batching in BATCHING, f"[run] batching must be one of {', '.join(BATCHING)}"),
            (self.train.precision in PRECISIONS, f"[train] precision must be one of {', '.join(PRECISIONS)}"),
            (
                self.run.aggregation in AGGREGATIONS,
                f"[run] aggregation must be one of {', '.join(AGGREGATIONS)}",
            ),
            (
                self.run.bn_statistics in STATISTICS_RULES,
                f"[run] bn_statistics must be one of {', '.join(STATISTICS_RULES)}, got {self.run.bn_statistics!r}",
            ),
            (0.0 <= self.run.trim_fraction < 0.5, "[run] trim_fraction must be in [0, 0.5)"),
            (self.run.update_norm_factor > 1, "[run] update_norm_factor must be > 1"),
            (
                self.run.max_update_norm is None or self.run.max_update_norm > 0,
                "[run] max_update_norm must be > 0",
            ),
            (
                self.run.clip_update_norm is None or self.run.clip_update_norm > 0,
                "[run] clip_update_norm must be > 0",
            ),
            (self.run.divergence_factor > 1, "[run] divergence_factor must be > 1"),
            (self.run.quarantine_rounds >= 0, "[run] quarantine_rounds must be >= 0"),
            (self.run.strike_rounds >= 0, "[run] strike_rounds must be >= 0 (0: off)"),
            (
                self.run.max_sample_factor == 0 or self.run.max_sample_factor >= 1,
                "[run] max_sample_factor must be >= 1 (0: off)",
            ),
            (0.0 <= self.run.max_weight_share <= 1.0, "[run] max_weight_share must be in [0, 1] (0: off)"),
            (self.run.bn_variance_factor > 1, "[run] bn_variance_factor must be > 1"),
            (self.run.bn_mean_sigmas > 0, "[run] bn_mean_sigmas must be > 0"),
        ]
        for ok, message in checks + self._server_time_checks() + self._transport_time_checks():
            if not ok:
                raise ConfigError(message)
        return self

    def _server_time_checks(self) -> list[tuple[bool, str]]:
        """[run] server_time and the keys of its mode: each key only with its mode, and only in a replay."""
        run = self.run
        mode = run.server_time
        fixed = {key: getattr(run, key) for key in FIXED_SERVER_TIMES}
        checks = [
            (
                mode in SERVER_TIMES,
                f"[run] server_time must be one of {', '.join(SERVER_TIMES)}, got {mode!r}",
            ),
            (
                mode == "none" or run.traces is not None,
                f"[run] server_time = {mode!r} moves a replay's virtual clock: it needs [run] traces",
            ),
        ]
        for key, value in fixed.items():
            checks.append(
                (
                    value is None or 0 <= value < math.inf,
                    f"[run] {key} must be a finite number of seconds >= 0",
                )
            )
            checks.append(
                (
                    value is None or mode == "fixed",
                    f'[run] {key} is used only with server_time = "fixed" (server_time is {mode!r})',
                )
            )
        checks.append(
            (
                mode != "fixed" or any(v is not None for v in fixed.values()),
                f'[run] server_time = "fixed" needs at least one of {", ".join(FIXED_SERVER_TIMES)}',
            )
        )
        factor = run.server_time_factor
        checks.append(
            (factor is None or 0 < factor < math.inf, "[run] server_time_factor must be a finite number > 0")
        )
        checks.append(
            (
                factor is None or mode == "measured",
                f'[run] server_time_factor is used only with server_time = "measured" (server_time is {mode!r})',
            )
        )
        return checks

    def _transport_time_checks(self) -> list[tuple[bool, str]]:
        """[run] transport_time and its keys: finite seconds >= 0, only with "fixed", only in a replay."""
        run = self.run
        mode = run.transport_time
        given = {key: getattr(run, key) for key in TRANSPORT_TIME_KEYS}
        checks = [
            (
                mode in TRANSPORT_TIMES,
                f"[run] transport_time must be one of {', '.join(TRANSPORT_TIMES)}, got {mode!r}",
            ),
            (
                mode == "none" or run.traces is not None,
                f"[run] transport_time = {mode!r} delays a replay's tasks: it needs [run] traces",
            ),
        ]
        for key, value in given.items():
            checks.append(
                (value is None or 0 <= value < math.inf, f"[run] {key} must be a finite number >= 0")
            )
            checks.append(
                (
                    value is None or mode == "fixed",
                    f'[run] {key} is used only with transport_time = "fixed" (transport_time is {mode!r})',
                )
            )
        checks.append(
            (
                mode != "fixed" or any(v is not None for v in given.values()),
                f'[run] transport_time = "fixed" needs at least one of {", ".join(TRANSPORT_TIME_KEYS)}',
            )
        )
        return checks


SECTIONS = {f.name: f.type for f in fields(SimConfig)}
_SECTION_TYPES = {
    "run": RunSection,
    "data": DataSection,
    "model": ModelSection,
    "method": MethodSection,
    "train": TrainSection,
}


# Optional fields default to None; check a given value against the declared type instead.
_OPTIONAL_SAMPLES: dict[str, Any] = {
    "bool | None": False,
    "int | None": 0,
    "float | None": 0.0,
    "str | None": "",
}


def _coerce(section: str, key: str, value: Any, default: Any, annotation: str = "") -> Any:
    if value is None:
        return value
    if default is None:
        default = _OPTIONAL_SAMPLES.get(annotation)
        if default is None:
            return value
    expected = type(default)
    if expected is bool and not isinstance(value, bool):
        raise ConfigError(f"[{section}] {key} must be true or false, got {value!r}")
    if expected in (int, float) and isinstance(value, bool):
        raise ConfigError(f"[{section}] {key} must be a number, got {value!r}")
    if expected is float and isinstance(value, int):
        return float(value)
    if expected in (int, float, str, list, dict) and not isinstance(value, expected):
        raise ConfigError(f"[{section}] {key} must be {expected.__name__}, got {value!r}")
    return value


def config_from_dict(data: dict[str, Any]) -> SimConfig:
    unknown = set(data) - set(_SECTION_TYPES)
    if unknown:
        raise ConfigError(f"unknown config sections {sorted(unknown)} (known: {', '.join(_SECTION_TYPES)})")
    built: dict[str, Any] = {}
    for name, cls in _SECTION_TYPES.items():
        values = data.get(name, {})
        if not isinstance(values, dict):
            raise ConfigError(f"[{name}] must be a table")
        defaults = cls()
        known = {f.name for f in fields(cls)}
        if name == "method":
            # Everything but `name` in [method] is a method option (validated by the strategy).
            options = {k: v for k, v in values.items() if k not in ("name", "options")}
            options.update(values.get("options", {}))
            built[name] = MethodSection(name=str(values.get("name", defaults.name)), options=options)
            continue
        bad = set(values) - known
        if bad:
            raise ConfigError(f"[{name}] unknown keys {sorted(bad)} (known: {', '.join(sorted(known))})")
        annotations = {f.name: str(f.type) for f in fields(cls)}
        kwargs = {k: _coerce(name, k, v, getattr(defaults, k), annotations[k]) for k, v in values.items()}
        built[name] = cls(**kwargs)
    return SimConfig(**built).validate()


def read_config_file(path: Path) -> dict[str, Any]:
    """A config file's raw tables (ConfigError when it is missing or not TOML)."""
    from nestling.wire.broker_settings import read_toml

    return read_toml(path, "config file")


def load_config(
    path: Path | None, overrides: dict[str, Any] | None = None, unset: tuple[str, ...] = ()
) -> SimConfig:
    """Read a TOML file (optional), drop its dotted keys in `unset` (back to their defaults, or gone for a
    method option) and apply dotted overrides like {"train.lr": 0.05}."""
    data: dict[str, Any] = read_config_file(path) if path is not None else {}
    for dotted in unset:
        section, _, key = dotted.partition(".")
        table = data.get(section)
        if not key or not isinstance(table, dict) or key not in table:
            raise ConfigError(f"--unset {dotted}: the config file sets no such key")
        del table[key]
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        section, _, key = dotted.partition(".")
        data.setdefault(section, {})[key] = value
    return config_from_dict(data)
