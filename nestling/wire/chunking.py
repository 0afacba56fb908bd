"""Chunked transfers: a large frame travels as fixed-size verified chunks; only lost chunks are resent.

Each chunk is a codec frame of kind "chunk" whose raw body is one slice of the payload; its header
names the transfer, the slice index, the chunk count and size, the total length and the sha256 of
the whole payload (the frame's own body sha256 covers the slice). See docs/protocol.md.
"""

from __future__ import annotations

import hashlib
import re
import struct
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from nestling.errors import ConfigError, WireError
from nestling.wire.codec import (
    CHUNK_KIND,
    CHUNK_REQUEST_KIND,
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_HEADER_BYTES,
    pack_frame,
    unpack_frame,
)
from nestling.wire.schemas import chunk_layout

DEFAULT_CHUNK_SIZE = 256 * 1024
MIN_CHUNK_SIZE = 1024  # bounds the chunk count of a transfer, hence the size of missing() lists
_TRANSFER_ID_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_FRAME_OVERHEAD = 9 + MAX_HEADER_BYTES  # preamble + largest header
_INDEX = struct.Struct(">I")
Clock = Callable[[], float]


def new_transfer_id() -> str:
    return uuid.uuid4().hex


def _check_transfer_id(transfer_id: Any) -> str:
    if not isinstance(transfer_id, str) or _TRANSFER_ID_PATTERN.fullmatch(transfer_id) is None:
        raise WireError(f"transfer id {transfer_id!r:.80} is not 1-64 of A-Z a-z 0-9 _ . -")
    return transfer_id


def _chunk_count(total_length: int, chunk_size: int) -> int:
    return max(1, -(-total_length // chunk_size))


def split_into_chunks(
    transfer_id: str, payload: bytes | bytearray | memoryview, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> list[bytes]:
    """Cut `payload` into encoded chunk frames, each verifiable on its own and as part of the whole."""
    _check_transfer_id(transfer_id)
    if not isinstance(chunk_size, int) or chunk_size < MIN_CHUNK_SIZE:
        raise ConfigError(f"chunk size must be an integer >= {MIN_CHUNK_SIZE} bytes, got {chunk_size!r}")
    view = memoryview(payload).cast("B")
    count = _chunk_count(len(view), chunk_size)
    common = {
        "transfer_id": transfer_id,
        "count": count,
        "chunk_size": chunk_size,
        "total_length": len(view),
        "payload_sha256": hashlib.sha256(view).hexdigest(),
    }
    return [
        pack_frame(
            CHUNK_KIND,
            {**common, "message_id": f"{transfer_id}.{index}", "index": index},
            view[index * chunk_size : (index + 1) * chunk_size],
        )
        for index in range(count)
    ]


def frames_to_send(
    payload: bytes, *, chunk_size: int = DEFAULT_CHUNK_SIZE, transfer_id: str | None = None
) -> tuple[str | None, list[bytes]]:
    """What to publish for one encoded message: itself if small, else its chunks (and their transfer id)."""
    if len(payload) <= chunk_size:
        return None, [payload]
    transfer_id = transfer_id or new_transfer_id()
    return transfer_id, split_into_chunks(transfer_id, payload, chunk_size)


def _chunk_layout(header: dict[str, Any], body_length: int) -> tuple[str, int, int, int, int, str]:
    """Validate a chunk header against itself; return (id, index, count, chunk size, total, sha)."""
    layout = chunk_layout(header)
    transfer_id, index, count = layout.transfer_id, layout.index, layout.count
    chunk_size, total_length, payload_sha256 = layout.chunk_size, layout.total_length, layout.payload_sha256
    if chunk_size < MIN_CHUNK_SIZE or count != _chunk_count(total_length, chunk_size) or index >= count:
        raise WireError(
            f"chunk of transfer {transfer_id}: inconsistent layout "
            f"(index {index}, count {count}, chunk size {chunk_size}, total {total_length})"
        )
    expected = min(chunk_size, total_length - index * chunk_size)
    if body_length != expected:
        raise WireError(
            f"chunk {index} of transfer {transfer_id} holds {body_length} bytes, expected {expected}"
        )
    return transfer_id, index, count, chunk_size, total_length, payload_sha256


@dataclass
class _Transfer:
    count: int
    chunk_size: int
    total_length: int
    payload_sha256: str
    last_seen: float
    parts: dict[int, memoryview] = field(default_factory=dict)
    buffered: int = 0


class ChunkAssembler:
    """Receiver side: collects chunks in any order, drops duplicates, returns each payload once, verified."""

    def __init__(
        self,
        *,
        max_transfers: int = 16,
        max_buffered_bytes: int = 512 * 1024 * 1024,
        max_payload_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        ttl_s: float = 60.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self.max_transfers = max_transfers
        self.max_buffered_bytes = max_buffered_bytes
        self.max_payload_bytes = max_payload_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._transfers: dict[str, _Transfer] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()  # late duplicates of these are ignored
        self.buffered_bytes = 0

    def add(self, chunk: bytes | bytearray | memoryview, now: float | None = None) -> bytes | None:
        """Take one chunk frame; return the whole payload when this chunk completes it, else None."""
        frame = unpack_frame(chunk, max_bytes=self.max_payload_bytes + _FRAME_OVERHEAD)
        if frame.header["kind"] != CHUNK_KIND:
            raise WireError(f"expected a {CHUNK_KIND!r} frame, got kind {frame.header['kind']!r}")
        transfer_id, index, count, chunk_size, total_length, payload_sha256 = _chunk_layout(
            frame.header, len(frame.body)
        )
        if transfer_id in self._finished:
            return None
        now = self._clock() if now is None else now
        transfer = self._transfers.get(transfer_id)
        if transfer is None:
            if total_length > self.max_payload_bytes:
                raise WireError(
                    f"transfer {transfer_id} of {total_length} bytes exceeds {self.max_payload_bytes} bytes",
                    "oversized",
                )
            if len(self._transfers) >= self.max_transfers:
                raise WireError(
                    f"too many concurrent transfers ({self.max_transfers}); dropped {transfer_id}",
                    "oversized",
                )
            transfer = _Transfer(count, chunk_size, total_length, payload_sha256, now)
            self._transfers[transfer_id] = transfer
        elif (count, chunk_size, total_length, payload_sha256) != (
            transfer.count,
            transfer.chunk_size,
            transfer.total_length,
            transfer.payload_sha256,
        ):
            raise WireError(f"chunk {index} disagrees with earlier chunks of transfer {transfer_id}")
        transfer.last_seen = now
        if index in transfer.parts:
            return None  # QoS 1 redelivery or an answered re-request that crossed a late original
        if self.buffered_bytes + len(frame.body) > self.max_buffered_bytes:
            raise WireError(
                f"chunk buffer full ({self.max_buffered_bytes} bytes); dropped chunk {index} of {transfer_id}",
                "oversized",
            )
        transfer.parts[index] = frame.body
        transfer.buffered += len(frame.body)
        self.buffered_bytes += len(frame.body)
        if len(transfer.parts) < transfer.count:
            return None
        self._forget(transfer_id)
        payload = b"".join(transfer.parts[i] for i in range(transfer.count))
        if hashlib.sha256(payload).hexdigest() != transfer.payload_sha256:
            raise WireError(f"transfer {transfer_id}: reassembled payload sha256 mismatch", "sha_mismatch")
        self._finished[transfer_id] = None
        while len(self._finished) > 4096:
            self._finished.popitem(last=False)
        return payload

    def missing(self, transfer_id: str) -> list[int]:
        """Indices still to come for a transfer in progress ([] once it completed)."""
        if transfer_id in self._finished:
            return []
        transfer = self._transfers.get(transfer_id)
        if transfer is None:
            raise WireError(f"unknown transfer {transfer_id!r}: no chunk of it has arrived (or it expired)")
        return [i for i in range(transfer.count) if i not in transfer.parts]

    def pending(self) -> list[str]:
        return list(self._transfers)

    def stalled(self, idle_s: float, now: float | None = None) -> list[str]:
        """Transfers with no chunk for `idle_s` seconds: time to re-request their missing chunks."""
        now = self._clock() if now is None else now
        return [tid for tid, t in self._transfers.items() if now - t.last_seen >= idle_s]

    def expire(self, now: float | None = None) -> list[str]:
        """Drop transfers idle for longer than ttl_s and free their buffers; return their ids."""
        now = self._clock() if now is None else now
        stale = [tid for tid, t in self._transfers.items() if now - t.last_seen > self.ttl_s]
        for transfer_id in stale:
            self._forget(transfer_id)
        return stale

    def _forget(self, transfer_id: str) -> None:
        transfer = self._transfers.pop(transfer_id)
        self.buffered_bytes -= transfer.buffered


@dataclass(frozen=True)
class ChunkRequest:
    """A receiver asking the sender to resend exactly these chunks of one transfer."""

    transfer_id: str
    indices: tuple[int, ...]


def encode_chunk_request(transfer_id: str, indices: Iterable[int]) -> bytes:
    """Encode a re-request; indices travel as big-endian uint32 in the body, so any count fits."""
    _check_transfer_id(transfer_id)
    wanted = sorted(set(indices))
    if not wanted or not all(isinstance(i, int) and 0 <= i < 2**32 for i in wanted):
        raise WireError(f"chunk request for {transfer_id} needs one or more indices in [0, 2^32)")
    body = b"".join(_INDEX.pack(i) for i in wanted)
    return pack_frame(CHUNK_REQUEST_KIND, {"transfer_id": transfer_id}, body)


def decode_chunk_request(payload: bytes | bytearray | memoryview) -> ChunkRequest:
    frame = unpack_frame(
        payload, max_bytes=_FRAME_OVERHEAD + 4 * (DEFAULT_MAX_MESSAGE_BYTES // MIN_CHUNK_SIZE)
    )
    if frame.header["kind"] != CHUNK_REQUEST_KIND:
        raise WireError(f"expected a {CHUNK_REQUEST_KIND!r} frame, got kind {frame.header['kind']!r}")
    transfer_id = _check_transfer_id(frame.header.get("transfer_id"))
    if not len(frame.body) or len(frame.body) % _INDEX.size:
        raise WireError(f"chunk request for {transfer_id}: body must be a non-empty list of uint32 indices")
    indices = tuple(sorted({i for (i,) in _INDEX.iter_unpack(frame.body)}))
    return ChunkRequest(transfer_id=transfer_id, indices=indices)


class ChunkCache:
    """Sender side: keeps recent transfers' chunks for a while to answer re-requests (bounded, LRU)."""

    def __init__(
        self,
        *,
        max_transfers: int = 8,
        max_bytes: int = 256 * 1024 * 1024,
        ttl_s: float = 120.0,
        clock: Clock = time.monotonic,
    ) -> None:
        self.max_transfers = max_transfers
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, list[bytes], int]] = OrderedDict()
        self.cached_bytes = 0

    def put(self, transfer_id: str, chunks: list[bytes], now: float | None = None) -> None:
        """Remember a transfer's chunks, evicting the oldest transfers to stay within bounds."""
        _check_transfer_id(transfer_id)
        size = sum(len(c) for c in chunks)
        if size > self.max_bytes:
            raise WireError(
                f"transfer {transfer_id} of {size} bytes exceeds the chunk cache ({self.max_bytes} bytes)",
                "oversized",
            )
        self.drop(transfer_id)
        while self._entries and (
            len(self._entries) >= self.max_transfers or self.cached_bytes + size > self.max_bytes
        ):
            self.drop(next(iter(self._entries)))
        self._entries[transfer_id] = (self._clock() if now is None else now, list(chunks), size)
        self.cached_bytes += size

    def get(self, transfer_id: str, indices: Iterable[int], now: float | None = None) -> list[bytes]:
        """The requested chunk frames, ready to publish again."""
        self.expire(now)
        entry = self._entries.get(transfer_id)
        if entry is None:
            raise WireError(
                f"transfer {transfer_id!r} is no longer cached (expired or evicted): resend the message"
            )
        chunks = entry[1]
        wanted = sorted(set(indices))
        if any(not 0 <= i < len(chunks) for i in wanted):
            raise WireError(f"chunk request for {transfer_id} names indices outside 0..{len(chunks) - 1}")
        return [chunks[i] for i in wanted]

    def answer(self, request: bytes | ChunkRequest, now: float | None = None) -> list[bytes]:
        """Decode a re-request (if still encoded) and return the chunks to publish again."""
        if not isinstance(request, ChunkRequest):
            request = decode_chunk_request(request)
        return self.get(request.transfer_id, request.indices, now)

    def drop(self, transfer_id: str) -> None:
        entry = self._entries.pop(transfer_id, None)
        if entry is not None:
            self.cached_bytes -= entry[2]

    def expire(self, now: float | None = None) -> list[str]:
        now = self._clock() if now is None else now
        stale = [tid for tid, (stored, _, _) in self._entries.items() if now - stored > self.ttl_s]
        for transfer_id in stale:
            self.drop(transfer_id)
        return stale
