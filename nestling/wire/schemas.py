"""The typed schema of every message a board sends the server, checked where the message is decoded.

One msgspec Struct per message body (hello profile, status resources, result meta and its metrics, chunk
header): every field's type, range, finiteness (a float outside its bounds, 1e999 included, is refused) and
size, and unknown fields refused by name. Strict conversion: no "5" for 5, no true for 1. Nothing from a
board reaches a strategy, the planner or the coordinator without passing here; docs/protocol.md lists the
fields. msgspec was chosen over pydantic because it is one small wheel with no dependencies (a board installs
it in a second, aarch64 included) and its Structs say each rule in one line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Union

import msgspec
from msgspec import Meta

from nestling.errors import WireError

MAX_COUNT = 10**9  # samples, steps: far above any board's, bounds what reaches an aggregation weight
MAX_BYTES = 2**50  # memory sizes: a petabyte
MAX_INDEX = 10**6  # client index, class label
MAX_TIER = 1023  # strategies clamp a tier to their last submodel; this only keeps the number sane
MAX_SECONDS = 1e7  # a local training time: four months
MAX_LOSS = 1e30  # a finite loss; a diverged one travels as null
MAX_GFLOPS = 1e5  # 100 TFLOP/s sustained fp32 training: above any single accelerator a board has
MAX_LIST = 100_000
MAX_EXTRA_METRICS = 32

Short = Annotated[str, Meta(min_length=1, max_length=128)]
Name = Annotated[str, Meta(min_length=1, max_length=64)]
Count = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
Bytes = Annotated[int, Meta(ge=0, le=MAX_BYTES)]
Seconds = Annotated[float, Meta(ge=0.0, le=MAX_SECONDS)]
Loss = Annotated[float, Meta(ge=-MAX_LOSS, le=MAX_LOSS)]


class _Schema(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Unknown fields are refused by name; fields left at their default are omitted when converted back."""


# -- hello: the board's profile --------------------------------------------------------------------
class Budget(_Schema):
    """A capacity the board states itself: memory training may use, and/or MACs per step (FedTrans)."""

    memory_bytes: Annotated[int, Meta(ge=1, le=MAX_BYTES)] | None = None
    macs: Annotated[float, Meta(gt=0.0, le=1e18)] | None = None


class ExportWish(_Schema):
    """The board asks for its submodel's deployable when the run ends."""

    on_finish: bool
    format: Annotated[str, Meta(pattern="^(onnx|tensorrt)$")] | None = None


class Emulation(_Schema, rename={"board_class": "class"}):
    """What an agent started with `--emulate CLASS` advertises (edge/emulation.py)."""

    board_class: Name
    trace_device: Short | None = None
    gflops: Annotated[float, Meta(gt=0.0, le=MAX_GFLOPS)] | None = None
    up_bps: Annotated[float, Meta(gt=0.0, le=1e12)] | None = None
    down_bps: Annotated[float, Meta(gt=0.0, le=1e12)] | None = None
    latency_s: Annotated[float, Meta(ge=0.0, le=3600.0)] | None = None
    measured_latency_models: Annotated[list[Name], Meta(max_length=64)] | None = None


class HelloProfile(_Schema):
    """A hello's body. `board_profile` is checked field by field by profiler/board_profile.py (its own schema)."""

    num_samples: Count
    index: Annotated[int, Meta(ge=0, le=MAX_INDEX)] | None = None
    tier: Annotated[int, Meta(ge=0, le=MAX_TIER)] | None = None
    labels: Annotated[list[Annotated[int, Meta(ge=0, le=MAX_INDEX)]], Meta(max_length=MAX_LIST)] | None = None
    memory_budget_bytes: Annotated[int, Meta(ge=1, le=MAX_BYTES)] | None = None
    budget: Budget | None = None
    profiling: bool = False
    board_profile: dict[str, Any] | None = None
    export: ExportWish | None = None
    emulating: Emulation | None = None
    dataset: Name | None = None
    # the board's fixed facts (edge/monitor.py): shown to the operator, never planned from
    machine: Name | None = None
    system: Name | None = None
    python: Name | None = None
    torch_version: Name | None = None
    torch_device: Name | None = None
    gpu: Short | None = None
    cores: Annotated[int, Meta(ge=1, le=65536)] | None = None
    torch_threads: Annotated[int, Meta(ge=1, le=65536)] | None = None
    total_memory_bytes: Bytes | None = None
    gpu_memory_bytes: Bytes | None = None


# -- status: the heartbeat's resource snapshot ------------------------------------------------------
class Resources(_Schema):
    """How loaded the board is (edge/monitor.py snapshot)."""

    cpu_percent: Annotated[float, Meta(ge=0.0, le=1e5)] | None = None
    available_memory_bytes: Bytes | None = None
    rss_bytes: Bytes | None = None
    peak_rss_bytes: Bytes | None = None
    temperature_c: Annotated[float, Meta(ge=-273.0, le=1000.0)] | None = None


# -- result: its meta and metrics --------------------------------------------------------------------
class Metrics(_Schema):
    """What edge/trainer.py measures, and the extras the built-in procedures report (edge/procedures)."""

    train_seconds: Seconds | None = None
    train_wall_s: Seconds | None = None
    loss_first: Loss | None = None
    loss_last: Loss | None = None
    loss_mean: Loss | None = None
    steps: Count | None = None
    peak_memory_bytes: Bytes | None = None
    peak_memory_kind: Name | None = None
    untouched: Annotated[list[Annotated[str, Meta(max_length=256)]], Meta(max_length=MAX_LIST)] | None = None
    stages: Count | None = None  # FeDepth
    bypassed: Count | None = None
    models: Count | None = None
    kd_weight: Annotated[float, Meta(ge=0.0, le=1e6)] | None = None  # distillation
    kd_active: bool | None = None
    dynamicfl_capacity: Count | None = None
    dynamicfl_expanded: Count | None = None
    dynamicfl_grown: Count | None = None
    dynamicfl_cut: Count | None = None
    dynamicfl_collapsed: Count | None = None
    dynamicfl_structure: Annotated[str, Meta(max_length=64 * 1024)] | None = None
    emulated: Name | None = None  # an agent emulating a slower board (edge/agent_training.py)
    emulated_down_s: Seconds | None = None
    emulated_compute_s: Seconds | None = None
    emulation_overrun_s: Annotated[float, Meta(ge=-MAX_SECONDS, le=MAX_SECONDS)] | None = None


# A plugin procedure's own scalars (LocalOutcome.extra): lower-case names, bounded finite values, few of them.
ExtraMetrics = Annotated[
    dict[
        Annotated[str, Meta(pattern="^[a-z][a-z0-9_]{0,63}$")],
        Union[  # noqa: UP007 (msgspec reads the Union at runtime on Python 3.10)
            bool,
            Annotated[int, Meta(ge=-(2**53), le=2**53)],
            Annotated[float, Meta(ge=-MAX_LOSS, le=MAX_LOSS)],
            Annotated[str, Meta(max_length=4096)],
        ],
    ],
    Meta(max_length=MAX_EXTRA_METRICS),
]
_METRIC_NAMES = frozenset(Metrics.__struct_fields__)


class ResultMeta(_Schema):
    """A result header's meta (the tensors are checked against the task by server/fleet_admission.py)."""

    task_id: Short
    session: Short
    num_samples: Count
    metrics: dict[str, Any]
    model_id: Short = "global"


# -- chunk header: the fields a chunk frame adds to the codec header ------------------------------
TransferId = Annotated[str, Meta(pattern="^[A-Za-z0-9_.-]{1,64}$")]


class ChunkRequestHeader(_Schema):
    """The field a chunk re-request adds to the codec header: which transfer it asks about."""

    transfer_id: TransferId


class ChunkLayout(_Schema):
    """Where one chunk sits in its transfer (nestling/wire/chunking.py checks the layout is consistent)."""

    transfer_id: TransferId
    index: Annotated[int, Meta(ge=0, le=2**32)]
    count: Annotated[int, Meta(ge=1, le=2**32)]
    chunk_size: Annotated[int, Meta(ge=1, le=2**40)]
    total_length: Annotated[int, Meta(ge=0, le=2**50)]
    payload_sha256: Annotated[str, Meta(pattern="^[0-9a-f]{64}$")]


def check(value: Any, schema: Any, what: str, reason: str) -> Any:
    """`value` converted to `schema`, or WireError(reason) naming the field and the rule it broke."""
    try:
        return msgspec.convert(value, schema, strict=True)
    except msgspec.ValidationError as error:
        raise WireError(f"{what}: {error}", reason) from None


def plain(record: msgspec.Struct) -> dict[str, Any]:
    """A checked record as a plain dict, fields left at their default omitted (`"tier" in profile` is honest)."""
    return msgspec.to_builtins(record)


def hello_profile(profile: Any) -> dict[str, Any]:
    """A hello's profile, checked (WireError `bad_hello`) and normalised."""
    return plain(check(profile, HelloProfile, "hello", "bad_hello"))


def status_resources(resources: Any) -> dict[str, Any]:
    """A heartbeat's resource snapshot, checked (WireError `bad_status`)."""
    return plain(check(resources, Resources, "status resources", "bad_status"))


def result_meta(meta: Any) -> tuple[ResultMeta, dict[str, Any]]:
    """A result's meta and its metrics (known ones typed, a procedure's extras bounded), or WireError `bad_result`."""
    checked: ResultMeta = check(meta, ResultMeta, "result", "bad_result")
    known = {k: v for k, v in checked.metrics.items() if k in _METRIC_NAMES}
    extra = {k: v for k, v in checked.metrics.items() if k not in _METRIC_NAMES}
    metrics = plain(check(known, Metrics, "result metrics", "bad_result"))
    # a null metric (a diverged loss sent as null) stays visible as null
    metrics.update({k: None for k, v in known.items() if v is None})
    metrics.update(check(extra, ExtraMetrics, "result metrics (a procedure's extras)", "bad_result"))
    return checked, metrics


def chunk_layout(header: Mapping[str, Any]) -> ChunkLayout:
    """The chunk fields of a chunk frame's header (WireError `bad_chunk`); the codec checked the rest."""
    fields = {name: header[name] for name in ChunkLayout.__struct_fields__ if name in header}
    layout: ChunkLayout = check(fields, ChunkLayout, "chunk header", "bad_chunk")
    return layout


def chunk_request_header(header: Mapping[str, Any]) -> ChunkRequestHeader:
    """The transfer a re-request names (WireError `bad_chunk`)."""
    checked: ChunkRequestHeader = check(
        {"transfer_id": header.get("transfer_id")}, ChunkRequestHeader, "chunk request header", "bad_chunk"
    )
    return checked
