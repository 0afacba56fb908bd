"""Fleet messages on the wire: Task, Result, hello, device and server status as codec frames.

Shared by the server (server/mqtt_transport.py) and the agent (edge/agent.py), so both sides read
and write exactly one layout. Every decoder checks field types and raises WireError naming the
field; nothing from the network reaches the coordinator unchecked. Tensors travel only in the
safetensors body (nestling.wire.codec); headers are JSON, never pickle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nestling.errors import WireError
from nestling.messages import Result, Task
from nestling.packed import pack
from nestling.wire.codec import Message, decode_message, encode_message
from nestling.wire.schemas import hello_profile, result_meta, status_resources

HELLO, STATUS, TASK, RESULT, REHELLO, SERVER_STATUS = (
    "hello",
    "status",
    "task",
    "result",
    "rehello",
    "server_status",
)
DEVICE_STATES = ("online", "training", "exporting")  # exporting: building its deployable after a run
SERVER_PHASES = ("waiting", "training", "aggregating", "done")
CONTROL_BYTES = 64 * 1024  # hello / status / ctrl frames carry no tensors: a header and nothing else


def _require(meta: dict[str, Any], name: str, kinds: type | tuple[type, ...], what: str) -> Any:
    value = meta.get(name)
    if isinstance(value, bool) or not isinstance(value, kinds):  # JSON true is not the integer 1
        raise WireError(f"field {name!r} must be {what}, got {value!r:.60}")
    return value


def _short(meta: dict[str, Any], name: str) -> str:
    value = _require(meta, name, str, "a string")
    if not 0 < len(value) <= 128:
        raise WireError(f"field {name!r} must have 1-128 characters")
    return value


def _json_safe(value: Any) -> Any:
    """NaN/Inf become None: a diverged loss must still travel (JSON has no NaN) and stay visible."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _expect(message: Message, kind: str) -> dict[str, Any]:
    if message.kind != kind:
        raise WireError(f"expected a {kind!r} message, got {message.kind!r}")
    return message.meta


# -- tasks (server → device) -------------------------------------------------------------------
def encode_task(task: Task, session: str) -> bytes:
    meta = {
        "task_id": task.task_id,
        "session": session,
        "spec": task.spec,
        "procedure": task.procedure,
        "hparams": _json_safe(task.hparams),
        "deadline_s": task.deadline_s,
        "model_id": task.model_id,
    }
    return encode_message(
        TASK,
        {"round": task.round, "device_id": task.device_id, "spec_id": task.spec_id, "meta": meta},
        task.weights,
    )


def decode_task(message: Message) -> tuple[Task, str]:
    """(Task, server session) from a decoded frame; the spec itself is checked when it is built."""
    meta = _expect(message, TASK)
    if message.round is None or message.device_id is None:
        raise WireError("a task names its round and device")
    deadline = meta.get("deadline_s")
    if deadline is not None and (not isinstance(deadline, (int, float)) or isinstance(deadline, bool)):
        raise WireError(f"field 'deadline_s' must be a number or null, got {deadline!r:.40}")
    task = Task(
        round=message.round,
        device_id=message.device_id,
        spec=_require(meta, "spec", dict, "an object"),
        weights=pack(message.tensors),  # one buffer: what the update screen reads in one operation
        procedure=_short(meta, "procedure"),
        hparams=_require(meta, "hparams", dict, "an object"),
        deadline_s=deadline,
        task_id=_short(meta, "task_id"),
        model_id=_short(meta, "model_id"),
    )
    return task, _short(meta, "session")


# -- results (device → server) -----------------------------------------------------------------
def encode_result(result: Result, session: str) -> bytes:
    meta = {
        "task_id": result.task_id,
        "session": session,
        "num_samples": result.num_samples,
        "metrics": _json_safe(result.metrics),
        "model_id": result.model_id,
    }
    return encode_message(
        RESULT,
        {"round": result.round, "device_id": result.device_id, "spec_id": result.spec_id, "meta": meta},
        result.weights,
    )


def decode_result(message: Message) -> tuple[Result, str]:
    """(Result, the server session it answers); meta and metrics checked against their schema
    (nestling.wire.schemas), tensors against the task by the receiver."""
    meta, metrics = result_meta(_expect(message, RESULT))
    if message.round is None or message.device_id is None or message.spec_id is None:
        raise WireError("a result names its round, device and spec")
    result = Result(
        round=message.round,
        device_id=message.device_id,
        task_id=meta.task_id,
        spec_id=message.spec_id,
        weights=message.tensors,
        num_samples=meta.num_samples,
        metrics=metrics,
        model_id=meta.model_id,
    )
    return result, meta.session


# -- hello and status (device → server, control size) ------------------------------------------
def encode_hello(device_id: str, profile: dict[str, Any]) -> bytes:
    return encode_message(HELLO, {"device_id": device_id, "meta": _json_safe(profile)})


def decode_hello(payload: bytes) -> tuple[str, dict[str, Any]]:
    """(device id, profile checked against nestling.wire.schemas.HelloProfile, defaults omitted)."""
    message = decode_message(payload, max_bytes=CONTROL_BYTES)
    profile = _expect(message, HELLO)
    if message.device_id is None or message.tensors:
        raise WireError("a hello names its device and carries no tensors")
    return message.device_id, hello_profile(profile)


@dataclass(frozen=True)
class DeviceStatus:
    """A heartbeat: the device is alive, idle or training `round`, with a resource snapshot."""

    device_id: str
    state: str
    round: int | None
    resources: dict[str, Any]


def encode_status(status: DeviceStatus) -> bytes:
    return encode_message(
        STATUS,
        {
            "device_id": status.device_id,
            "round": status.round,
            "meta": {"state": status.state, "resources": _json_safe(status.resources)},
        },
    )


def decode_status(payload: bytes) -> DeviceStatus:
    message = decode_message(payload, max_bytes=CONTROL_BYTES)
    meta = _expect(message, STATUS)
    state = meta.get("state")
    if message.device_id is None or state not in DEVICE_STATES:
        raise WireError(f"a status names its device and a state in {DEVICE_STATES}, got {state!r:.40}")
    unknown = sorted(set(meta) - {"state", "resources"})
    if unknown:
        raise WireError(f"status: unknown field(s) {', '.join(map(str, unknown))[:80]}", "bad_status")
    return DeviceStatus(message.device_id, state, message.round, status_resources(meta.get("resources")))


# -- server status (retained) and control ------------------------------------------------------
@dataclass(frozen=True)
class ServerStatus:
    """What the server is doing; `session` changes on every server start, which tells agents to re-hello."""

    session: str
    phase: str
    round: int | None
    # What boards should profile: {"spec": the full model's SubmodelSpec dict, "batch": local batch size}.
    plan: dict[str, Any] | None = None


MAX_PLAN_BATCH = 65536


def encode_server_status(status: ServerStatus) -> bytes:
    meta: dict[str, Any] = {"session": status.session, "phase": status.phase}
    if status.plan is not None:
        meta["plan"] = status.plan
    return encode_message(SERVER_STATUS, {"round": status.round, "meta": meta})


def _plan(meta: dict[str, Any]) -> dict[str, Any] | None:
    plan = meta.get("plan")
    if plan is None:
        return None
    batch = plan.get("batch") if isinstance(plan, dict) else None
    if (
        not isinstance(plan, dict)
        or not isinstance(plan.get("spec"), dict)
        or isinstance(batch, bool)
        or not isinstance(batch, int)
        or not 1 <= batch <= MAX_PLAN_BATCH
    ):
        raise WireError(f"server status 'plan' must be {{spec: object, batch: 1..{MAX_PLAN_BATCH}}}")
    return {"spec": plan["spec"], "batch": batch}


def decode_server_status(payload: bytes) -> ServerStatus:
    message = decode_message(payload, max_bytes=CONTROL_BYTES)
    meta = _expect(message, SERVER_STATUS)
    phase = meta.get("phase")
    if phase not in SERVER_PHASES:
        raise WireError(f"server phase must be one of {SERVER_PHASES}, got {phase!r:.40}")
    return ServerStatus(_short(meta, "session"), phase, message.round, _plan(meta))


def encode_rehello(session: str) -> bytes:
    """Server → device on ctrl: "I do not know you (I restarted): send your hello again"."""
    return encode_message(REHELLO, {"meta": {"session": session}})
