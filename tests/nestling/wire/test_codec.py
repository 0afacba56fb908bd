"""The message codec round-trips tensors exactly and rejects every defect with a named reason."""

import hashlib
import json
import struct

import pytest
import torch
from safetensors.torch import save as save_safetensors

from nestling.errors import WireError
from nestling.wire.codec import (
    MAGIC,
    MAX_HEADER_BYTES,
    SCHEMA_VERSION,
    check_finite,
    decode_message,
    encode_message,
    pack_frame,
    read_header,
)

PREAMBLE = struct.Struct(">4sBI")


def sample_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "stem.weight": torch.randn(8, 3, 3, 3, generator=generator),
        "blocks.0.step": torch.tensor([0.5]),
        "half": torch.randn(4, 5, generator=generator).half(),
        "brain": torch.randn(6, generator=generator).bfloat16(),
        "counts": torch.arange(10, dtype=torch.int64),
        "mask": torch.tensor([True, False]),
    }


def frame(header: dict | bytes, body: bytes = b"", *, magic: bytes = MAGIC, version: int = 1) -> bytes:
    """Hand-build a frame so each rejection can be provoked in isolation."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return PREAMBLE.pack(magic, version, len(raw)) + raw + body


def valid_header(body: bytes = b"", **changes) -> dict:
    header = {
        "schema": SCHEMA_VERSION,
        "kind": "result",
        "message_id": "m1",
        "round": 1,
        "device_id": "d1",
        "spec_id": None,
        "body_sha256": hashlib.sha256(body).hexdigest(),
        "body_length": len(body),
        "meta": {},
    }
    header.update(changes)
    return header


def test_round_trip_keeps_values_dtypes_and_header():
    tensors = sample_tensors()
    payload = encode_message(
        "result", {"round": 7, "device_id": "rpi-2", "spec_id": "abc", "meta": {"loss": [0.9, 0.5]}}, tensors
    )
    message = decode_message(payload)
    assert (message.kind, message.round, message.device_id, message.spec_id) == ("result", 7, "rpi-2", "abc")
    assert message.meta == {"loss": [0.9, 0.5]} and len(message.message_id) == 32
    assert message.header["schema"] == SCHEMA_VERSION
    assert set(message.tensors) == set(tensors)
    for name, tensor in tensors.items():
        assert message.tensors[name].dtype == tensor.dtype
        assert torch.equal(message.tensors[name], tensor)


def test_views_and_non_contiguous_tensors_are_packed_not_refused():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {"rows": base[:2], "cols": base[:, :3], "grad": torch.ones(3, requires_grad=True) * 2}
    decoded = decode_message(encode_message("task", {}, tensors)).tensors
    assert torch.equal(decoded["cols"], base[:, :3]) and torch.equal(decoded["rows"], base[:2])


def test_message_without_tensors_has_an_empty_body():
    payload = encode_message("hello", {"device_id": "d1", "meta": {"profile": {"ram_mb": 512}}})
    message = decode_message(payload)
    assert message.tensors == {} and message.header["body_length"] == 0
    assert read_header(payload)["meta"]["profile"]["ram_mb"] == 512


def test_encoder_refuses_what_a_decoder_could_not_read():
    with pytest.raises(WireError, match="unknown header field"):
        encode_message("result", {"rnd": 1})
    with pytest.raises(WireError, match="computed by the codec"):
        pack_frame("result", {"body_sha256": "0" * 64}, b"")
    with pytest.raises(WireError, match="reserved for chunked transfers"):
        encode_message("chunk", {})
    with pytest.raises(WireError, match="not JSON-serialisable"):
        encode_message("result", {"meta": {"x": float("nan")}})
    with pytest.raises(WireError, match="'round' must be"):
        encode_message("result", {"round": -1})
    with pytest.raises(WireError, match=r"torch\.Tensor"):
        encode_message("result", {}, {"w": [1.0, 2.0]})


GOOD_BODY = save_safetensors({"w": torch.ones(4)})


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (frame(valid_header(), magic=b"NOPE"), "wrong magic"),
        (b"NST", "truncated preamble"),
        (frame(valid_header(), version=9), "unknown format version 9"),
        (frame(valid_header(schema=99)), "unknown schema version 99"),
        (frame(valid_header(schema="1")), "unknown schema version"),
        (frame(b"{not json"), "malformed JSON header"),
        (frame(b"\xff\xfe"), "malformed JSON header"),
        (frame(b"[1, 2]"), "expected an object"),
        (frame(b'{"schema": 1, "x": NaN}'), "malformed JSON header"),
        (frame(b"[" * 5000 + b"]" * 5000), "malformed JSON header"),
        (PREAMBLE.pack(MAGIC, 1, MAX_HEADER_BYTES + 1), "header of .* exceeds"),
        (PREAMBLE.pack(MAGIC, 1, 100) + b"{}", "truncated header"),
        (
            frame({k: v for k, v in valid_header().items() if k not in ("kind", "meta")}),
            "missing field.*kind, meta",
        ),
        (frame(valid_header(round="3")), "'round' must be"),
        (frame(valid_header(body_sha256="xyz")), "'body_sha256' must be"),
        (frame(valid_header(GOOD_BODY), GOOD_BODY[:-3]), "truncated body"),
        (frame(valid_header(GOOD_BODY), GOOD_BODY + b"\0"), "beyond its declared length"),
        (frame(valid_header(GOOD_BODY), GOOD_BODY[:-1] + b"\1"), "sha256 mismatch"),
        (frame(valid_header(b"not safetensors"), b"not safetensors"), "safetensors parse error"),
        (frame(valid_header(kind="chunk")), "chunk header"),  # a chunk without its layout
    ],
)
def test_every_defect_is_rejected_with_its_reason(payload, reason):
    with pytest.raises(WireError, match=reason):
        decode_message(payload)


def test_oversized_message_is_rejected_before_parsing():
    payload = encode_message("result", {}, {"w": torch.zeros(1000)})
    assert decode_message(payload, max_bytes=len(payload)).tensors["w"].shape == (1000,)
    with pytest.raises(WireError, match="exceeds the limit"):
        decode_message(payload, max_bytes=len(payload) - 1)


def test_unknown_header_fields_are_refused_by_name():
    """A new field is a new schema version (SUPPORTED_SCHEMA_VERSIONS), never a silent extra."""
    with pytest.raises(WireError, match="unknown header field.*added_in_a_later_minor"):
        decode_message(frame(valid_header(added_in_a_later_minor="x")))


def test_check_finite_names_the_first_poisoned_tensor():
    check_finite({"w": torch.ones(3), "n": torch.arange(3)})
    poisoned = {
        "ok": torch.ones(2),
        "bad": torch.tensor([1.0, float("nan")]),
        "worse": torch.tensor([float("inf")]),
    }
    with pytest.raises(WireError, match="tensor 'bad' contains NaN or Inf"):
        check_finite(poisoned)
    with pytest.raises(WireError, match="'h'"):
        check_finite({"h": torch.tensor([float("-inf")], dtype=torch.float16)})


def test_wire_errors_carry_the_reason_a_server_counts_them_under() -> None:
    """Admission files errors by `reason`, never by parsing the message."""
    from nestling.wire.codec import check_finite

    with pytest.raises(WireError) as caught:
        check_finite({"w": torch.tensor([float("nan")])})
    assert caught.value.reason == "non_finite"
    assert WireError("anything").reason == "malformed"
