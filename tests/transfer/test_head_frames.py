"""Frames of a head range (TP re-sharding): a nonzero first head travels as version 4 in bytes 26..27, a
frame from head 0 stays version 3 byte for byte, and v4 frames are rejected as strictly as v3 ones."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.worker.transfer import codec
from pdcluster.worker.transfer.frame import (
    HEADER,
    VERSION,
    VERSION_HEADS,
    ErrorCode,
    Frame,
    FrameError,
    FrameKey,
    Kind,
    Limits,
    decode_frame,
    encode_frame,
)

KEY = FrameKey(b"h" * 32)


def kv(tokens: int = 5, heads: int = 2, dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(tokens, heads, dim, generator=g), torch.randn(tokens, heads, dim, generator=g)


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_head_range_round_trips_as_version_4(compression: str) -> None:
    k, v = kv()
    buf = encode_frame(codec.encode_layer("r", 1, 2, k, v, compression=compression, head_start=5), KEY)
    assert buf[4] == VERSION_HEADS and HEADER.unpack_from(buf)[12] == 5
    got = decode_frame(buf, KEY)
    assert (got.head_start, got.kv_heads, got.status) == (5, 2, 0)
    dk, dv = codec.decode_layer(got)
    tol = 0 if compression == "none" else 0.05
    assert torch.allclose(dk, k, atol=tol) and torch.allclose(dv, v, atol=tol)


def test_a_frame_from_head_0_is_todays_version_3_frame() -> None:
    k, v = kv()
    whole = codec.encode_layer("r", 1, 2, k, v)
    assert whole.head_start == 0
    buf = encode_frame(whole, KEY)
    assert buf[4] == VERSION == 3 and HEADER.unpack_from(buf)[12] == 0
    # identical to a frame built without the new field at all (what a version-3-only build emits)
    legacy = Frame(kind=Kind.LAYER, request_id="r", layer=1, num_layers=2, token_start=0, token_end=5, kv_heads=2,
                   head_dim=8, payload=whole.payload)
    assert encode_frame(legacy, KEY) == buf
    assert decode_frame(buf, KEY).head_start == 0


def _with(buf: bytes, **fields: int) -> bytes:
    """The frame with some header fields changed (its header tag no longer matches: the parser must refuse
    the header itself first, with the code under test)."""
    names = ["magic", "version", "kind", "flags", "dtype", "rid_len", "layer", "num_layers", "t0", "t1", "heads",
             "dim", "status", "scales_len", "payload_len"]
    vals = dict(zip(names, HEADER.unpack_from(buf), strict=True))
    vals.update(fields)
    frame = decode_frame(buf, KEY)
    return HEADER.pack(*(vals[n] for n in names)) + encode_frame(frame, KEY)[HEADER.size:]


@pytest.mark.parametrize(("over", "code"), [
    ({"kind": 2}, ErrorCode.BAD_HEADER),  # a version-4 ACK: the field is for data frames only
    ({"kind": 3}, ErrorCode.BAD_HEADER),
    ({"status": 1023}, ErrorCode.BAD_HEADER),  # head_start + kv_heads beyond max_kv_heads (1024)
    ({"version": 5}, ErrorCode.BAD_VERSION),
])
def test_malformed_version_4_headers(over: dict[str, int], code: ErrorCode) -> None:
    k, v = kv()
    buf = encode_frame(codec.encode_layer("r", 1, 2, k, v, head_start=3), KEY)
    with pytest.raises(FrameError) as e:
        decode_frame(_with(buf, **over), KEY)
    assert e.value.code == code


def test_version_3_data_frame_still_refuses_a_nonzero_status() -> None:
    k, v = kv()
    buf = encode_frame(codec.encode_layer("r", 1, 2, k, v), KEY)
    with pytest.raises(FrameError, match="status is only meaningful on ACK"):
        decode_frame(_with(buf, status=3), KEY)


def test_encoder_refuses_a_head_range_on_an_ack() -> None:
    with pytest.raises(FrameError):
        encode_frame(dataclasses.replace(Frame(kind=Kind.ACK, request_id="r"), head_start=2), KEY)


VALID = encode_frame(codec.encode_layer("r", 0, 2, *kv(2, 2, 4), head_start=6), KEY)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), max_size=8),
       st.integers(0, len(VALID)))
def test_tampered_or_truncated_head_range_frames_are_rejected(edits: list[tuple[int, int]], cut: int) -> None:
    buf = bytearray(VALID)
    for pos, val in edits:
        buf[pos] = val
    data = bytes(buf[:cut])
    try:
        frame = decode_frame(data, KEY, 0, Limits(max_frame_bytes=64 * 1024))
    except FrameError:
        return
    assert data == VALID and frame.head_start == 6  # only the untouched frame authenticates


def test_staged_mac_binds_the_head_range() -> None:
    """NIXL: a head range's staged bytes are signed with its first head in the nonce; head 0 keeps the
    nonce of before (layer, token_start, zeros), so whole-layer MACs are unchanged."""
    import struct

    from pdcluster.worker.transfer import nixl_wire

    secret, salt, data = b"k" * 32, b"s" * 16, b"staged bytes"
    d = nixl_wire.Descriptor(0, len(data), 0, salt, nixl_wire.mac(secret, salt, "r", 1, 0, data, 3), "a", b"m")
    assert nixl_wire.verify(secret, d, "r", 1, 0, data, 3)
    assert not nixl_wire.verify(secret, d, "r", 1, 0, data, 2) and not nixl_wire.verify(secret, d, "r", 1, 0, data)
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    before = AESGCM(nixl_wire._key(secret, salt, "r")).encrypt(struct.pack(">HI6x", 1, 5), b"", data)
    assert nixl_wire.mac(secret, salt, "r", 1, 5, data) == before
