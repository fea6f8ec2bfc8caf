"""Hypothesis fuzzing of the frame parser: any byte string gives a Frame or a FrameError — never another
exception, and never an allocation beyond the limit (the header is validated before the body is read)."""

from __future__ import annotations

import asyncio
import tracemalloc

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcluster.worker.transfer import codec
from pdcluster.worker.transfer.channel import read_frame
from pdcluster.worker.transfer.frame import (
    HEADER,
    VERSION,
    FrameError,
    FrameKey,
    Limits,
    decode_frame,
    encode_frame,
    parse_header,
)
from pdcluster.worker.transfer.sockio import Closed

SECRET = FrameKey(b"k" * 32)


def feeder(data: bytes):  # type: ignore[no-untyped-def]
    """A socket's recv_into over `data`, then EOF (what Conn.recv_into does)."""
    pos = 0

    async def recv_into(view: memoryview) -> None:
        nonlocal pos
        n = min(len(view), len(data) - pos)
        view[:n] = data[pos:pos + n]
        pos += n
        if n < len(view):
            raise Closed(n)

    return recv_into
LIMITS = Limits(max_frame_bytes=64 * 1024)


def _valid() -> bytes:
    import torch

    k = torch.arange(2 * 2 * 4, dtype=torch.float32).reshape(2, 2, 4)
    return encode_frame(codec.encode_layer("r", 0, 2, k, -k), SECRET)


VALID = _valid()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400))
def test_random_bytes_never_crash(data: bytes) -> None:
    try:
        decode_frame(data, SECRET, 0, LIMITS)
    except FrameError:
        pass


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), max_size=8),
       st.integers(0, len(VALID)))
def test_mutated_valid_frame_never_crash(edits: list[tuple[int, int]], cut: int) -> None:
    buf = bytearray(VALID)
    for pos, val in edits:
        buf[pos] = val
    data = bytes(buf[:cut])
    try:
        frame = decode_frame(data, SECRET, 0, LIMITS)
    except FrameError:
        return
    # Only an untouched frame authenticates.
    assert data == VALID and frame.request_id == "r"


FABRIC = Limits(max_frame_bytes=64 * 1024, trust_fabric=True)
VALID_FABRIC = encode_frame(decode_frame(VALID, SECRET, 0), SECRET, 0, FABRIC)
PAYLOAD = range(len(VALID_FABRIC) - 32 - 2 * 2 * 2 * 4 * 4, len(VALID_FABRIC) - 32)  # K+V bytes: before the trailer


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(VALID_FABRIC) - 1), st.integers(0, 255)), max_size=8),
       st.integers(0, len(VALID_FABRIC)))
def test_mutated_fabric_frame_never_crash_and_only_its_payload_is_trusted(edits: list[tuple[int, int]],
                                                                         cut: int) -> None:
    """--kv-transfer-integrity fabric: the payload is the one part of a frame left to the network; any other
    change, or a cut, is still refused."""
    buf = bytearray(VALID_FABRIC)
    for pos, val in edits:
        buf[pos] = val
    data = bytes(buf[:cut])
    try:
        decode_frame(data, SECRET, 0, FABRIC)
    except FrameError:
        return
    assert len(data) == len(VALID_FABRIC)
    assert all(a == b for i, (a, b) in enumerate(zip(data, VALID_FABRIC, strict=True)) if i not in PAYLOAD)


header_fields = st.tuples(
    st.sampled_from([b"PDKV", b"XXXX"]), st.integers(0, 255), st.integers(0, 255), st.integers(0, 255),
    st.integers(0, 255), *[st.integers(0, 0xFFFF)] * 3, *[st.integers(0, 0xFFFFFFFF)] * 2,
    *[st.integers(0, 0xFFFF)] * 3, *[st.integers(0, 0xFFFFFFFF)] * 2,
)


@settings(max_examples=600, deadline=None)
@given(header_fields)
def test_any_header_is_bounded(fields: tuple) -> None:  # type: ignore[type-arg]
    head = HEADER.pack(*fields)
    try:
        hdr = parse_header(head, LIMITS)
    except FrameError:
        return
    assert 36 + hdr.body_len <= LIMITS.max_frame_bytes


@settings(max_examples=150, deadline=None)
@given(header_fields, st.binary(max_size=256))
def test_stream_reader_allocates_at_most_the_limit(fields: tuple, tail: bytes) -> None:  # type: ignore[type-arg]
    """A header claiming a huge body must not make the reader allocate it (a lying peer)."""
    async def go() -> None:
        try:
            await read_frame(feeder(HEADER.pack(*fields) + tail), SECRET, 0, LIMITS)
        except FrameError:
            pass

    tracemalloc.start()
    try:
        asyncio.run(go())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < LIMITS.max_frame_bytes + 512 * 1024


@st.composite
def consistent_header(draw: st.DrawFn) -> bytes:
    """Headers whose lengths agree with their shape, so they get past the cheap checks."""
    tokens = draw(st.integers(1, 1 << 20))
    heads = draw(st.integers(1, 64))
    dim = draw(st.integers(1, 256))
    int8 = draw(st.booleans())
    scales = 2 * tokens * heads * 4 if int8 else 0
    payload = 2 * tokens * heads * dim * (1 if int8 else 4)
    if payload > 0xFFFFFFFF or scales > 0xFFFFFFFF:
        payload &= 0xFFFFFFFF
        scales &= 0xFFFFFFFF
    return HEADER.pack(b"PDKV", VERSION, 1, int(int8), 4 if int8 else 1, draw(st.integers(1, 128)), 0, 1, 0, tokens,
                       heads, dim, 0, scales, payload)


@settings(max_examples=200, deadline=None)
@given(consistent_header(), st.binary(max_size=512))
def test_consistent_headers_with_short_bodies(head: bytes, tail: bytes) -> None:
    async def go() -> None:
        try:
            await read_frame(feeder(head + tail), SECRET, 0, LIMITS)
        except FrameError:
            pass
        else:
            raise AssertionError("a frame with a random body authenticated")

    tracemalloc.start()
    try:
        asyncio.run(go())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < LIMITS.max_frame_bytes + 512 * 1024
