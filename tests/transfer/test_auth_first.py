"""Issue 15 item 5: the KV port authenticates a peer before it accepts a body. A consistent header without the
secret's MAC is refused after the 68-byte preamble (no body buffered), connections waiting to authenticate
are capped and timed out, and all bodies together stay under a byte budget."""

from __future__ import annotations

import asyncio
import struct

import pytest

from pdcluster.worker.transfer.frame import (
    HEADER,
    PREAMBLE_SIZE,
    VERSION,
    ErrorCode,
    FrameError,
    Kind,
    header_mac,
)
from pdcluster.worker.transfer.transport import ByteBudget, KVServer, read_frame

SECRET = b"s" * 32
TOKENS, HEADS, DIM = 4096, 8, 128  # a 32 MiB f32 layer


def big_header() -> bytes:
    """A header that passes every structural check and announces a 32 MiB body (what an attacker can forge)."""
    payload = 2 * TOKENS * HEADS * DIM * 4
    return HEADER.pack(b"PDKV", VERSION, int(Kind.LAYER), 0, 1, 3, 0, 1, 0, TOKENS, HEADS, DIM, 0, 0, payload)


async def server(**kw) -> KVServer:  # type: ignore[no-untyped-def]
    async def handler(_frame) -> ErrorCode:  # type: ignore[no-untyped-def]
        return ErrorCode.OK

    s = KVServer(SECRET, handler, **kw)
    await s.start("127.0.0.1", 0)
    return s


async def test_forged_header_is_refused_before_the_body() -> None:
    s = await server()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", s.port)
        # No secret: a made-up header MAC. (Only the preamble: unread body bytes would turn the server's
        # close into a reset that eats its ACK.) The refusal comes at once, not after a body timeout.
        w.write(big_header() + b"\0" * 32)
        await w.drain()
        reply = await asyncio.wait_for(read_frame(r, SECRET, timeout=2.0), 3.0)
        assert reply.kind == Kind.ACK and reply.status == ErrorCode.UNAUTHENTICATED
        assert await asyncio.wait_for(r.read(), 3.0) == b""  # and the connection is closed
        assert s.budget.used == 0 and s.stats.frames_rejected == 1
        w.close()
    finally:
        await s.close()


async def test_a_valid_header_mac_lets_the_body_in() -> None:
    s = await server(frame_timeout=2.0)
    try:
        r, w = await asyncio.open_connection("127.0.0.1", s.port)
        head = big_header()
        w.write(head + header_mac(SECRET, head) + b"x" * 1024)  # authenticated, then stalls mid-body
        await w.drain()
        for _ in range(100):
            if s.budget.used:
                break
            await asyncio.sleep(0.01)
        assert s.unauthenticated == 0 and s.budget.used == 2 * TOKENS * HEADS * DIM * 4 + 3 + 36
        reply = await asyncio.wait_for(read_frame(r, SECRET, timeout=5.0), 6.0)  # frame_timeout ends it
        assert reply.status == ErrorCode.TRUNCATED and s.budget.used == 0
        w.close()
    finally:
        await s.close()


async def test_unauthenticated_connections_are_capped_and_timed_out() -> None:
    s = await server(max_unauthenticated=3, auth_timeout=0.5)
    try:
        idle = [await asyncio.open_connection("127.0.0.1", s.port) for _ in range(3)]
        await asyncio.sleep(0.1)
        assert s.unauthenticated == 3
        r, w = await asyncio.open_connection("127.0.0.1", s.port)
        assert await asyncio.wait_for(r.read(), 2.0) == b""  # the 4th is closed at once
        w.close()
        for r, w in idle:  # the 3 silent ones are dropped after auth_timeout
            assert (await asyncio.wait_for(read_frame(r, SECRET, timeout=3.0), 4.0)).status == ErrorCode.TRUNCATED
            w.close()
        assert s.unauthenticated == 0
    finally:
        await s.close()


async def test_byte_budget_waits_and_refuses_what_can_never_fit() -> None:
    b = ByteBudget(100)
    await b.acquire(60)
    waiter = asyncio.ensure_future(b.acquire(50))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    b.release(60)
    await asyncio.wait_for(waiter, 1.0)
    assert b.used == 50
    with pytest.raises(FrameError) as e:
        await b.acquire(101)
    assert e.value.code == ErrorCode.TOO_LARGE


def test_preamble_is_header_plus_mac() -> None:
    assert PREAMBLE_SIZE == HEADER.size + 32 and struct.calcsize(">I") == 4
