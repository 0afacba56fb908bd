"""Wire protocol: topic scheme, message codec, chunked transfers and the MQTT client factory."""

from nestling.wire.chunking import (
    DEFAULT_CHUNK_SIZE,
    ChunkAssembler,
    ChunkCache,
    ChunkRequest,
    decode_chunk_request,
    encode_chunk_request,
    frames_to_send,
    split_into_chunks,
)
from nestling.wire.codec import (
    DEFAULT_MAX_MESSAGE_BYTES,
    SCHEMA_VERSION,
    Message,
    check_finite,
    decode_message,
    encode_message,
    read_header,
)
from nestling.wire.topics import QOS, FleetTopics, ParsedTopic, parse_topic, validate_id

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "QOS",
    "SCHEMA_VERSION",
    "ChunkAssembler",
    "ChunkCache",
    "ChunkRequest",
    "FleetTopics",
    "Message",
    "ParsedTopic",
    "check_finite",
    "decode_chunk_request",
    "decode_message",
    "encode_chunk_request",
    "encode_message",
    "frames_to_send",
    "parse_topic",
    "read_header",
    "split_into_chunks",
    "validate_id",
]
