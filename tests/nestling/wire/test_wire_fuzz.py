"""Hostile bytes never escape the wire layer as anything but WireError (and never pass as valid)."""

import json
import struct

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nestling.errors import WireError
from nestling.wire.chunking import (
    ChunkAssembler,
    decode_chunk_request,
    encode_chunk_request,
    split_into_chunks,
)
from nestling.wire.codec import MAGIC, decode_message, encode_message

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VALID_MESSAGE = encode_message(
    "result",
    {"round": 2, "device_id": "d1", "meta": {"loss": 0.5}},
    {"w": torch.arange(12.0), "n": torch.ones(2)},
)
VALID_CHUNKS = split_into_chunks("fuzz", bytes(range(256)) * 12, chunk_size=1024)
VALID_REQUEST = encode_chunk_request("fuzz", [0, 2])


@st.composite
def mutated(draw, original: bytes) -> bytes:
    """A valid frame with a few bytes flipped, cut, or inserted: the realistic corruptions."""
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["flip", "truncate", "insert", "delete"]))
        position = draw(st.integers(0, max(len(data) - 1, 0)))
        if action == "flip" and data:
            data[position] ^= draw(st.integers(1, 255))
        elif action == "truncate":
            del data[position:]
        elif action == "insert":
            data[position:position] = draw(st.binary(min_size=1, max_size=8))
        elif data:
            del data[position]
    return bytes(data)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def hostile_headers(draw) -> bytes:
    """Well-framed messages whose JSON header holds arbitrary keys and values."""
    keys = [
        "schema",
        "kind",
        "message_id",
        "round",
        "device_id",
        "spec_id",
        "body_sha256",
        "body_length",
        "meta",
    ]
    header = {key: draw(json_values) for key in keys if draw(st.booleans())}
    header.update(draw(st.dictionaries(st.text(max_size=8), json_values, max_size=3)))
    raw = json.dumps(header).encode()
    body = draw(st.binary(max_size=64))
    return MAGIC + struct.pack(">BI", 1, len(raw)) + raw + body


def decoded_or_none(decode, payload: bytes):
    """The decoded value, or None if refused with WireError; any other exception fails the test."""
    try:
        return decode(payload)
    except WireError:
        return None


@FUZZ
@given(st.binary(max_size=2048))
def test_random_bytes_are_refused(payload):
    assert decoded_or_none(decode_message, payload) is None
    assert decoded_or_none(ChunkAssembler().add, payload) is None
    assert decoded_or_none(decode_chunk_request, payload) is None


@FUZZ
@given(mutated(VALID_MESSAGE))
def test_mutated_messages_never_deliver_altered_tensors(payload):
    # The header is not hashed (TCP and TLS guard it in transit), so an edit that keeps it valid,
    # such as another message id, may pass; the tensors are covered by the body sha256 and may not.
    message = decoded_or_none(decode_message, payload)
    if message is not None:
        assert message.tensors.keys() == {"w", "n"}
        assert torch.equal(message.tensors["w"], torch.arange(12.0))
        assert torch.equal(message.tensors["n"], torch.ones(2))


@FUZZ
@given(mutated(VALID_CHUNKS[1]), st.booleans())
def test_mutated_chunks_never_corrupt_a_transfer(payload, deliver_rest_first):
    assembler = ChunkAssembler()
    others = [c for i, c in enumerate(VALID_CHUNKS) if i != 1]
    # A mutated chunk that claims another layout for the same transfer makes the honest ones clash.
    order = [*others, payload] if deliver_rest_first else [payload, *others]
    results = [decoded_or_none(assembler.add, chunk) for chunk in order]
    completed = [r for r in results if r is not None]
    assert completed in ([], [bytes(range(256)) * 12])  # never a wrong payload


@FUZZ
@given(hostile_headers())
def test_hostile_headers_are_refused(payload):
    assert decoded_or_none(decode_message, payload) is None
    assert decoded_or_none(ChunkAssembler().add, payload) is None


@FUZZ
@given(mutated(VALID_REQUEST))
def test_mutated_chunk_requests_never_ask_for_other_chunks(payload):
    request = decoded_or_none(decode_chunk_request, payload)
    assert request is None or request.indices == (0, 2)
