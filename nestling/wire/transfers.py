"""Both ends of a chunked fleet transfer: send (and answer re-requests), receive (and re-request gaps).

The server sends tasks and receives results; the agent does the reverse. Each side keeps its sent
chunks in a ChunkCache for a while and re-requests only the missing chunks of a stalled inbound
transfer (nestling.wire.chunking), with a bounded number of attempts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nestling.errors import WireError
from nestling.wire.chunking import (
    ChunkAssembler,
    ChunkCache,
    decode_chunk_request,
    encode_chunk_request,
    frames_to_send,
)

Clock = Callable[[], float]


class Outbound:
    """Frames to publish for one encoded message; chunked ones are kept to answer re-requests."""

    def __init__(
        self,
        chunk_size: int,
        *,
        max_cached_bytes: int = 512 * 1024 * 1024,
        ttl_s: float = 300.0,
        max_transfers: int = 256,
    ) -> None:
        self.chunk_size = chunk_size
        self.cache = ChunkCache(max_transfers=max_transfers, max_bytes=max_cached_bytes, ttl_s=ttl_s)
        self.owners: dict[str, str] = {}  # transfer id → the peer it was sent to (only it may re-request)

    def frames(self, payload: bytes, peer: str) -> list[bytes]:
        transfer_id, frames = frames_to_send(payload, chunk_size=self.chunk_size)
        if transfer_id is not None:
            self.cache.put(transfer_id, frames)
            self.owners[transfer_id] = peer
            if len(self.owners) > 4 * self.cache.max_transfers:  # forget owners of long-evicted transfers
                for old in list(self.owners)[: len(self.owners) // 2]:
                    del self.owners[old]
        return frames

    def answer(self, request: bytes, peer: str) -> list[bytes]:
        """Chunks to resend for a re-request from `peer`; WireError if it is not `peer`'s transfer."""
        decoded = decode_chunk_request(request)
        if self.owners.get(decoded.transfer_id) != peer:
            raise WireError(f"transfer {decoded.transfer_id!r} was not sent to {peer!r}")
        return self.cache.answer(decoded)


@dataclass
class _Asked:
    last: float
    attempts: int = 0


@dataclass
class Inbound:
    """Reassembles one peer's chunked messages and says when to re-request which chunks."""

    max_payload_bytes: int
    stall_s: float = 1.0
    max_attempts: int = 5
    ttl_s: float = 60.0
    clock: Clock = time.monotonic
    asked: dict[str, _Asked] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.assembler = ChunkAssembler(
            max_transfers=2,
            max_buffered_bytes=2 * self.max_payload_bytes,
            max_payload_bytes=self.max_payload_bytes,
            ttl_s=self.ttl_s,
            clock=self.clock,
        )

    def add(self, chunk: bytes) -> bytes | None:
        """The verified payload when `chunk` completes it (WireError for a bad chunk)."""
        payload = self.assembler.add(chunk)
        if payload is not None:
            self.asked = {t: a for t, a in self.asked.items() if t in self.assembler.pending()}
        return payload

    def requests(self) -> list[bytes]:
        """Encoded re-requests for transfers stalled `stall_s`, at most `max_attempts` each."""
        now = self.clock()
        out = []
        for transfer_id in self.assembler.stalled(self.stall_s, now):
            asked = self.asked.setdefault(transfer_id, _Asked(last=now - self.stall_s))
            if asked.attempts >= self.max_attempts or now - asked.last < self.stall_s:
                continue
            missing = self.assembler.missing(transfer_id)
            if missing:
                asked.last, asked.attempts = now, asked.attempts + 1
                out.append(encode_chunk_request(transfer_id, missing))
        return out

    def expired(self) -> list[str]:
        """Transfers given up on (idle past ttl_s): their chunks never all came."""
        gone = self.assembler.expire()
        for transfer_id in gone:
            self.asked.pop(transfer_id, None)
        return gone
