"""The KV port authenticates a peer before it accepts a body (issue 15 item 5, kept by the v3 transport of
issue 12). A peer without the secret gets no further than the handshake (69 bytes read from it, no body
buffer); an authenticated peer's header is checked by its tag before the body; connections in the handshake
are capped and timed out; all bodies together stay under a byte budget; and a sender never gives KV to a
receiver that cannot prove it holds the secret."""

from __future__ import annotations

import asyncio

import pytest

from pdcluster.worker.transfer import codec, handshake
from pdcluster.worker.transfer.channel import TransferError, open_channel, read_exact
from pdcluster.worker.transfer.frame import (
    HEADER,
    PREAMBLE_SIZE,
    TAG_SIZE,
    VERSION,
    ErrorCode,
    FrameError,
    FrameKey,
    Kind,
)
from pdcluster.worker.transfer.outbox import Outbox
from pdcluster.worker.transfer.sockio import Conn
from pdcluster.worker.transfer.transport import ByteBudget, KVServer

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


async def hung_up(r: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(r.read(), 3.0) == b""
    except ConnectionResetError:  # it left our extra bytes unread
        return True


async def test_a_peer_without_the_secret_gets_no_further_than_the_handshake() -> None:
    s = await server()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", s.port)
        w.write(handshake.hello(b"n" * 32))
        await w.drain()
        await asyncio.wait_for(r.readexactly(handshake.SERVER_PROOF.size), 3.0)
        # A made-up proof, then a consistent header announcing 32 MiB: refused at the proof, at once.
        w.write(b"\0" * handshake.CLIENT_PROOF_SIZE + big_header() + b"\0" * TAG_SIZE)
        await w.drain()
        assert await hung_up(r)
        assert s.budget.used == 0 and s.stats.frames_rejected == 1 and s.unauthenticated == 0
        w.close()
    finally:
        await s.close()


async def test_forged_header_tag_is_refused_before_the_body() -> None:
    s = await server()
    try:
        chan = await open_channel("127.0.0.1", s.port, SECRET)
        # Authenticated connection, but a header tag made with the wrong key (an injected or replayed frame).
        head = big_header()
        await chan.conn.send([head + FrameKey(b"x" * 32).tag(b"hdr\0", 0, head)])
        reply = await asyncio.wait_for(chan.read_frame(), 3.0)
        assert reply.kind == Kind.ACK and reply.status == ErrorCode.UNAUTHENTICATED
        assert s.budget.used == 0 and s.stats.frames_rejected == 1
        chan.close()
    finally:
        await s.close()


async def test_a_valid_header_tag_lets_the_body_in() -> None:
    s = await server(frame_timeout=2.0)
    try:
        chan = await open_channel("127.0.0.1", s.port, SECRET)
        head = big_header()
        await chan.conn.send([head + chan.keys.send.tag(b"hdr\0", 0, head), b"x" * 1024])  # then stalls
        for _ in range(100):
            if s.budget.used:
                break
            await asyncio.sleep(0.01)
        assert s.unauthenticated == 0 and s.budget.used == 2 * TOKENS * HEADS * DIM * 4 + 3 + 2 * TAG_SIZE
        reply = await asyncio.wait_for(chan.read_frame(), 6.0)  # frame_timeout ends it
        assert reply.status == ErrorCode.TRUNCATED and s.budget.used == 0
        chan.close()
    finally:
        await s.close()


async def test_unauthenticated_connections_are_capped_and_timed_out() -> None:
    s = await server(max_unauthenticated=3, auth_timeout=0.5)
    try:
        idle = [await asyncio.open_connection("127.0.0.1", s.port) for _ in range(3)]
        await asyncio.sleep(0.1)
        assert s.unauthenticated == 3
        r, w = await asyncio.open_connection("127.0.0.1", s.port)
        assert await hung_up(r)  # the 4th is closed at once
        w.close()
        for r, w in idle:  # the 3 silent ones are dropped after auth_timeout
            assert await hung_up(r)
            w.close()
        assert s.unauthenticated == 0
    finally:
        await s.close()


async def test_a_receiver_without_the_secret_never_gets_kv() -> None:
    """An impostor on the transfer port (it answers the handshake with another secret) is refused by the
    sender at once (UNAUTHENTICATED, no retry), and receives not one frame byte."""
    received: list[int] = []

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nc = handshake.parse_hello(await reader.readexactly(handshake.HELLO.size))
        writer.write(handshake.server_proof(b"w" * 32, nc, b"m" * 32))
        await writer.drain()
        received.append(len(await reader.read()))

    srv = await asyncio.start_server(impostor, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    box = Outbox("127.0.0.1", port, SECRET, timeout=5, max_retries=2)
    k = torch_kv()
    box.put(codec.encode_layer("r", 0, 1, k, k))
    with pytest.raises(TransferError) as e:
        await box.wait()
    assert e.value.code == ErrorCode.UNAUTHENTICATED and box.attempts == 0
    await asyncio.sleep(0.2)
    assert received == [0]
    srv.close()


def torch_kv():  # type: ignore[no-untyped-def]
    import torch

    return torch.ones(4, 2, 8)


async def test_handshake_garbage_is_a_frame_error() -> None:
    a, b = __import__("socket").socketpair()
    ca, cb = Conn(a), Conn(b)
    await ca.send([b"GET / HTTP/1.1\r\n\r\n" + b"x" * 40])
    with pytest.raises(FrameError) as e:
        handshake.parse_hello(await read_exact(cb.recv_into, handshake.HELLO.size))
    assert e.value.code == ErrorCode.BAD_MAGIC
    ca.close()
    cb.close()


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


def test_preamble_is_header_plus_tag() -> None:
    assert PREAMBLE_SIZE == HEADER.size + TAG_SIZE == 52
