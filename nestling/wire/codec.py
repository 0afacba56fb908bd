"""Message codec: a small JSON header plus a safetensors body in one verified frame (never pickle).

Frame layout: MAGIC (4 bytes) | format version (1 byte) | header length (4 bytes, big-endian) |
header (UTF-8 JSON object) | body. The header carries the body's length and sha256, so a frame is
checked in full before a single tensor is built from it. docs/protocol.md describes it for readers.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from nestling.errors import WireError
from nestling.wire.schemas import ChunkLayout, chunk_layout, chunk_request_header

MAGIC = b"NSTL"
FORMAT_VERSION = 1  # the byte after MAGIC: how the frame itself is laid out
SCHEMA_VERSION = 1  # header["schema"]: which header fields exist and what they mean
SUPPORTED_SCHEMA_VERSIONS = frozenset({1})
MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_MESSAGE_BYTES = 128 * 1024 * 1024  # a ResNet-18 fp32 result is 44.7 MB
# Frames whose body is raw bytes rather than safetensors; nestling.wire.chunking handles them.
CHUNK_KIND, CHUNK_REQUEST_KIND = "chunk", "chunk_request"
TRANSFER_KINDS = frozenset({CHUNK_KIND, CHUNK_REQUEST_KIND})

_PREAMBLE = struct.Struct(">4sBI")  # magic, format version, header length
_KIND_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,31}")
_SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")
_COMPUTED_FIELDS = ("schema", "kind", "body_sha256", "body_length")
_CALLER_FIELDS = ("message_id", "round", "device_id", "spec_id", "meta")
# The only header fields besides the common ones: what a chunk (or a re-request) says of its transfer.
_KIND_FIELDS = {
    CHUNK_KIND: frozenset(ChunkLayout.__struct_fields__),
    CHUNK_REQUEST_KIND: frozenset({"transfer_id"}),
}


# No honest frame carries an integer anywhere near 2**53 (a round, a schema, a count): bounding them here
# keeps 10**400 and friends from ever reaching float() or an index further in.
MAX_WIRE_INT = 2**53


def _is_int(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= MAX_WIRE_INT


def _is_short_str(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 128


# field -> (check, what a legal value looks like); the same rules guard encoding and decoding.
_FIELD_RULES: dict[str, tuple[Any, str]] = {
    "schema": (_is_int, "an integer"),
    "kind": (lambda v: isinstance(v, str) and _KIND_PATTERN.fullmatch(v) is not None, "a lowercase word"),
    "message_id": (_is_short_str, "a string of 1-128 characters"),
    "round": (lambda v: v is None or _is_int(v), "an integer in [0, 2**53] or null"),
    "device_id": (lambda v: v is None or _is_short_str(v), "a string of 1-128 characters or null"),
    "spec_id": (lambda v: v is None or _is_short_str(v), "a string of 1-128 characters or null"),
    "body_sha256": (
        lambda v: isinstance(v, str) and _SHA256_PATTERN.fullmatch(v) is not None,
        "64 hex digits",
    ),
    "body_length": (_is_int, "an integer >= 0"),
    "meta": (lambda v: isinstance(v, dict), "a JSON object"),
}


@dataclass
class Frame:
    """A verified frame: header checked, body length and sha256 matched; body not yet parsed."""

    header: dict[str, Any]
    body: memoryview


@dataclass
class Message:
    """A decoded message: its header (see docs/protocol.md) and the tensors of its body."""

    header: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @property
    def kind(self) -> str:
        return self.header["kind"]

    @property
    def message_id(self) -> str:
        return self.header["message_id"]

    @property
    def round(self) -> int | None:
        return self.header["round"]

    @property
    def device_id(self) -> str | None:
        return self.header["device_id"]

    @property
    def spec_id(self) -> str | None:
        return self.header["spec_id"]

    @property
    def meta(self) -> dict[str, Any]:
        return self.header["meta"]


def _check_fields(header: Mapping[str, Any]) -> None:
    missing = [name for name in _FIELD_RULES if name not in header]
    if missing:
        raise WireError(f"header is missing field(s): {', '.join(missing)}")
    for name, (is_legal, legal) in _FIELD_RULES.items():
        if not is_legal(header[name]):
            raise WireError(f"header field {name!r} must be {legal}, got {header[name]!r:.80}")
    unknown = sorted(set(header) - set(_FIELD_RULES) - _KIND_FIELDS.get(header["kind"], frozenset()))
    if unknown:
        raise WireError(f"unknown header field(s) {', '.join(unknown)[:120]} for kind {header['kind']!r}")
    if header["kind"] == CHUNK_KIND:  # typed here, so a receiver may route by them before reading the body
        chunk_layout(header)
    elif header["kind"] == CHUNK_REQUEST_KIND:
        chunk_request_header(header)


def pack_frame(kind: str, header: Mapping[str, Any], body: bytes | bytearray | memoryview = b"") -> bytes:
    """Frame `body` under a header; fills schema, kind, body length and sha256 (and a message id)."""
    clashing = [name for name in _COMPUTED_FIELDS if name in header]
    if clashing:
        raise WireError(f"header field(s) {', '.join(clashing)} are computed by the codec; do not pass them")
    full: dict[str, Any] = {"message_id": uuid.uuid4().hex, "round": None, "device_id": None, "spec_id": None}
    full.update(header)
    full.setdefault("meta", {})
    full.update(
        schema=SCHEMA_VERSION,
        kind=kind,
        body_sha256=hashlib.sha256(body).hexdigest(),
        body_length=len(body),
    )
    _check_fields(full)
    try:
        header_json = json.dumps(full, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as error:
        raise WireError(f"header is not JSON-serialisable: {error}") from error
    if len(header_json) > MAX_HEADER_BYTES:
        raise WireError(
            f"header of {len(header_json)} bytes exceeds the limit of {MAX_HEADER_BYTES} bytes", "oversized"
        )
    return b"".join((_PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header_json)), header_json, body))


def _reject_json_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _parse_header(view: memoryview, max_bytes: int) -> tuple[dict[str, Any], int]:
    """Check preamble and header; return the header and the offset where the body starts."""
    if len(view) > max_bytes:
        raise WireError(f"message of {len(view)} bytes exceeds the limit of {max_bytes} bytes", "oversized")
    if len(view) < _PREAMBLE.size:
        raise WireError(f"truncated preamble: {len(view)} bytes, need {_PREAMBLE.size}")
    magic, format_version, header_length = _PREAMBLE.unpack_from(view)
    if magic != MAGIC:
        raise WireError(f"wrong magic {bytes(magic)!r}, expected {MAGIC!r}: not a Nestling message")
    if format_version != FORMAT_VERSION:
        raise WireError(
            f"unknown format version {format_version} (supported: {FORMAT_VERSION})", "unknown_schema"
        )
    if header_length > MAX_HEADER_BYTES:
        raise WireError(
            f"header of {header_length} bytes exceeds the limit of {MAX_HEADER_BYTES} bytes", "oversized"
        )
    body_start = _PREAMBLE.size + header_length
    if len(view) < body_start:
        raise WireError(f"truncated header: {len(view) - _PREAMBLE.size} of {header_length} bytes")
    try:
        header = json.loads(bytes(view[_PREAMBLE.size : body_start]), parse_constant=_reject_json_constant)
    except (ValueError, RecursionError) as error:
        raise WireError(f"malformed JSON header: {error}") from error
    if not isinstance(header, dict):
        raise WireError(f"malformed JSON header: expected an object, got {type(header).__name__}")
    schema = header.get("schema")
    if "schema" in header and (not _is_int(schema) or schema not in SUPPORTED_SCHEMA_VERSIONS):
        supported = ", ".join(map(str, sorted(SUPPORTED_SCHEMA_VERSIONS)))
        raise WireError(f"unknown schema version {schema!r:.40} (supported: {supported})", "unknown_schema")
    _check_fields(header)
    return header, body_start


def read_header(
    payload: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> dict:
    """The checked header alone (body untouched): lets a receiver route by kind cheaply."""
    return _parse_header(memoryview(payload), max_bytes)[0]


def unpack_frame(
    payload: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> Frame:
    """Check a whole frame: preamble, header, body length and body sha256."""
    view = memoryview(payload).cast("B")
    header, body_start = _parse_header(view, max_bytes)
    body = view[body_start:]
    declared = header["body_length"]
    if len(body) < declared:
        raise WireError(f"truncated body: {len(body)} of {declared} bytes")
    if len(body) > declared:
        raise WireError(f"body has {len(body) - declared} bytes beyond its declared length {declared}")
    if hashlib.sha256(body).hexdigest() != header["body_sha256"]:
        raise WireError("body sha256 mismatch: the body was corrupted or altered in transit", "sha_mismatch")
    return Frame(header=header, body=body)


def encode_message(
    kind: str, header: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | None = None
) -> bytes:
    """Encode a message; `header` may set message_id, round, device_id, spec_id and meta only."""
    if kind in TRANSFER_KINDS:
        raise WireError(f"kind {kind!r} is reserved for chunked transfers (nestling.wire.chunking)")
    unknown = sorted(set(header) - set(_CALLER_FIELDS))
    if unknown:
        raise WireError(
            f"unknown header field(s) {', '.join(unknown)} (allowed: {', '.join(_CALLER_FIELDS)})"
        )
    body = b""
    if tensors:
        prepared: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise WireError(
                    f"tensors must map names to torch.Tensor, got {name!r}: {type(tensor).__name__}"
                )
            prepared[name] = tensor.detach().to("cpu").contiguous()
        try:
            body = save_safetensors(prepared)
        except (ValueError, RuntimeError, TypeError) as error:
            raise WireError(f"cannot serialise tensors to safetensors: {error}") from error
    return pack_frame(kind, header, body)


def decode_message(
    payload: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> Message:
    """Decode and verify a message; every defect raises WireError naming it, nothing else escapes."""
    frame = unpack_frame(payload, max_bytes=max_bytes)
    kind = frame.header["kind"]
    if kind in TRANSFER_KINDS:
        raise WireError(
            f"kind {kind!r} is a transfer frame; give it to nestling.wire.chunking, not decode_message"
        )
    tensors: dict[str, torch.Tensor] = {}
    if len(frame.body):
        try:
            tensors = load_safetensors(bytes(frame.body))
        except BaseException as error:  # SafetensorError, or pyo3's PanicException (a BaseException)
            if isinstance(error, (KeyboardInterrupt, SystemExit)):
                raise
            raise WireError(f"safetensors parse error: {error}") from error
    return Message(header=frame.header, tensors=tensors)


def check_finite(tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise WireError naming the first tensor holding NaN or Inf (a poisoned update)."""
    for name, tensor in tensors.items():
        if (tensor.is_floating_point() or tensor.is_complex()) and not bool(torch.isfinite(tensor).all()):
            raise WireError(f"tensor {name!r} contains NaN or Inf", "non_finite")
