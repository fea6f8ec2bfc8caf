"""Frame format: round trips, authentication, and every class of malformed input."""

from __future__ import annotations

import pytest
import torch

from pdcluster.worker.transfer import codec
from pdcluster.worker.transfer.frame import (
    HEADER,
    PREAMBLE_SIZE,
    VERSION,
    DType,
    ErrorCode,
    Frame,
    FrameError,
    FrameKey,
    Kind,
    Limits,
    decode_frame,
    encode_frame,
    parse_header,
    seal_frame,
)
from pdcluster.worker.transfer.secret import SecretError, load_secret

KEY = FrameKey(b"s" * 32)


def layer_frame(tokens: int = 7, heads: int = 2, dim: int = 8, compression: str = "none",
                dtype: torch.dtype = torch.float32) -> tuple[Frame, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(tokens)
    k = torch.randn(tokens, heads, dim, generator=g).to(dtype)
    v = torch.randn(tokens, heads, dim, generator=g).to(dtype)
    return codec.encode_layer("req-1", 3, 4, k, v, compression=compression), k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_exact_for_float_dtypes(dtype: torch.dtype) -> None:
    frame, k, v = layer_frame(dtype=dtype)
    back = decode_frame(encode_frame(frame, KEY), KEY)
    assert back == frame
    k2, v2 = codec.decode_layer(back, out_dtype=dtype)
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_int8_round_trip_is_close_and_half_the_fp16_bytes() -> None:
    frame, k, v = layer_frame(tokens=64, heads=4, dim=64, compression="int8")
    fp16, _, _ = layer_frame(tokens=64, heads=4, dim=64, dtype=torch.float16)
    assert frame.dtype == DType.I8 and frame.quantized
    k2, v2 = codec.decode_layer(decode_frame(encode_frame(frame, KEY), KEY))
    # per-vector absmax/127: error at most half a step of each vector's scale
    assert (k2 - k).abs().max() <= k.abs().amax(-1).max() / 127 / 2 + 1e-6
    assert (v2 - v).abs().max() <= v.abs().amax(-1).max() / 127 / 2 + 1e-6
    wire = len(frame.payload) + len(frame.scales)
    assert wire <= 0.55 * len(fp16.payload)


def test_wrong_secret_is_unauthenticated() -> None:
    frame, _, _ = layer_frame()
    with pytest.raises(FrameError) as e:
        decode_frame(encode_frame(frame, KEY), FrameKey(b"t" * 32))
    assert e.value.code == ErrorCode.UNAUTHENTICATED


def test_every_flipped_bit_region_is_unauthenticated() -> None:
    """Header, request id, scales, payload and both body tags: any change fails a tag (no crc to fix up)."""
    frame, _, _ = layer_frame(compression="int8")
    good = encode_frame(frame, KEY)
    for pos in (PREAMBLE_SIZE, PREAMBLE_SIZE + 6, PREAMBLE_SIZE + 10, len(good) // 2, len(good) - 20, len(good) - 1,
                HEADER.size + 3):
        buf = bytearray(good)
        buf[pos] ^= 0x01
        with pytest.raises(FrameError) as e:
            decode_frame(bytes(buf), KEY)
        assert e.value.code == ErrorCode.UNAUTHENTICATED, pos


def test_replayed_or_reordered_frame_fails_its_position() -> None:
    """The tag binds the frame to its position on the connection: frame 0 replayed as frame 1 is refused,
    and so is a frame sealed for another direction's (or connection's) key."""
    frame, _, _ = layer_frame()
    first = encode_frame(frame, KEY, seq=0)
    assert decode_frame(first, KEY, seq=0) == frame
    for key, seq in ((KEY, 1), (FrameKey(b"o" * 32), 0)):
        with pytest.raises(FrameError) as e:
            decode_frame(first, key, seq=seq)
        assert e.value.code == ErrorCode.UNAUTHENTICATED


def test_payload_is_sent_from_where_it_lies() -> None:
    frame, _, _ = layer_frame(tokens=64)
    parts = seal_frame(frame, KEY, 0)
    assert any(p is frame.payload for p in parts)  # scatter-gather: the payload buffer itself, not a copy
    assert b"".join(parts) == encode_frame(frame, KEY)


def test_truncated_at_every_length_is_rejected() -> None:
    frame, _, _ = layer_frame(tokens=2, heads=1, dim=4)
    buf = encode_frame(frame, KEY)
    for n in range(len(buf)):
        with pytest.raises(FrameError) as e:
            decode_frame(buf[:n], KEY)
        assert e.value.code in (ErrorCode.TRUNCATED,)
    with pytest.raises(FrameError):
        decode_frame(buf + b"\0", KEY)


def _header(**over: int) -> bytes:
    f = dict(magic=b"PDKV", version=VERSION, kind=1, flags=0, dtype=1, rid=5, layer=0, layers=2, t0=0, t1=4,
             heads=2, dim=8, status=0, scales=0, payload=2 * 4 * 2 * 8 * 4)
    f.update(over)  # type: ignore[arg-type]
    return HEADER.pack(*f.values())


@pytest.mark.parametrize("over,code", [
    (dict(magic=b"HTTP"), ErrorCode.BAD_MAGIC),
    (dict(version=2), ErrorCode.BAD_VERSION),  # version 2 had per-frame HMAC-SHA256 + crc32
    (dict(kind=9), ErrorCode.BAD_HEADER),
    (dict(dtype=7), ErrorCode.BAD_HEADER),
    (dict(flags=0x80), ErrorCode.BAD_HEADER),
    (dict(rid=0), ErrorCode.BAD_HEADER),
    (dict(rid=500), ErrorCode.BAD_HEADER),
    (dict(layer=2), ErrorCode.BAD_HEADER),
    (dict(t0=5, t1=4), ErrorCode.BAD_HEADER),
    (dict(payload=12), ErrorCode.BAD_HEADER),  # does not match the declared shape
    (dict(flags=1), ErrorCode.BAD_HEADER),  # int8 flag with a f32 dtype
    (dict(status=3), ErrorCode.BAD_HEADER),  # status on a LAYER frame
    (dict(heads=4000), ErrorCode.BAD_HEADER),
])
def test_malformed_headers(over: dict[str, int], code: ErrorCode) -> None:
    with pytest.raises(FrameError) as e:
        parse_header(_header(**over))
    assert e.value.code == code


def test_oversized_frame_rejected_from_header_alone() -> None:
    # 1M tokens * 8 heads * 128 dim * 4 B * 2 = 8 GiB claimed: refused before any allocation.
    big = _header(t1=1 << 20, heads=8, dim=128, payload=(2 * (1 << 20) * 8 * 128 * 4) & 0xFFFFFFFF)
    with pytest.raises(FrameError):
        parse_header(big)
    ok_shape = _header(t1=1000, heads=8, dim=128, payload=2 * 1000 * 8 * 128 * 4)
    with pytest.raises(FrameError) as e:
        parse_header(ok_shape, Limits(max_frame_bytes=1 << 20))
    assert e.value.code == ErrorCode.TOO_LARGE


def test_encoder_refuses_what_parser_would_refuse() -> None:
    with pytest.raises(FrameError):
        encode_frame(Frame(kind=Kind.LAYER, request_id="x" * 200), KEY)


def test_secret_sources(tmp_path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "s"
    f.write_text("f" * 32 + "\n")
    assert load_secret(str(f), env={"PDCLUSTER_KV_SECRET": "e" * 32}) == b"f" * 32
    assert load_secret(None, env={"PDCLUSTER_KV_SECRET": "e" * 32}) == b"e" * 32
    with pytest.raises(SecretError):
        load_secret(None, env={})
    with pytest.raises(SecretError):
        load_secret(None, env={"PDCLUSTER_KV_SECRET": "short"})
