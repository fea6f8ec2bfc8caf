"""The TCP transport and the connector, in one process over loopback."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdcluster.worker.transfer import codec
from pdcluster.worker.transfer.channel import TransferError, open_channel
from pdcluster.worker.transfer.connector import LoadSpec, TCPConnector, TransferTarget
from pdcluster.worker.transfer.frame import ErrorCode, Frame, Kind, seal_frame
from pdcluster.worker.transfer.options import TransferOptions
from pdcluster.worker.transfer.outbox import Outbox
from pdcluster.worker.transfer.sockio import Conn
from pdcluster.worker.transfer.transport import KVServer
from tests.transfer.kvsink import Sink

SECRET = b"a" * 32
LAYERS, TOKENS, HEADS, DIM = 3, 11, 2, 8


def kv(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(layer)
    return torch.randn(TOKENS, HEADS, DIM, generator=g), torch.randn(TOKENS, HEADS, DIM, generator=g)


async def pair(compression: str = "none", **kw: object) -> tuple[TCPConnector, TCPConnector, dict, TransferTarget]:
    got = Sink()
    recv = TCPConnector(SECRET, TransferOptions(), importer=got)
    port = await recv.listen()
    send = TCPConnector(SECRET, TransferOptions(compression=compression), **kw)  # type: ignore[arg-type]
    return send, recv, got, TransferTarget("127.0.0.1", port)


async def closed(r: asyncio.StreamReader) -> bool:
    """The server hung up (a reset when it left our extra bytes unread)."""
    try:
        return await asyncio.wait_for(r.read(), 5) == b""
    except ConnectionResetError:
        return True


def spec(rid: str) -> LoadSpec:
    return LoadSpec(rid, LAYERS, TOKENS, HEADS, DIM)


@pytest.mark.parametrize("compression", ["none", "int8"])
async def test_layers_arrive_and_get_finished(compression: str) -> None:
    send, recv, got, target = await pair(compression)
    recv.start_load_kv(spec("r1"))
    send.start_save("r1", target, LAYERS)
    for i in range(LAYERS):
        send.save_kv_layer("r1", i, *kv(i))
    await recv.wait_for_layer_load("r1", 0)
    res = await send.wait_for_save("r1")
    assert res.bytes > 0
    await recv.wait_for_load("r1", timeout=5)
    for i in range(LAYERS):
        k, v = kv(i)
        tol = 0 if compression == "none" else 0.05
        assert torch.allclose(got[("r1", i)][0], k, atol=tol) and torch.allclose(got[("r1", i)][1], v, atol=tol)
    assert send.get_finished() == ({"r1"}, set())
    assert recv.get_finished() == (set(), {"r1"})
    await send.close()
    await recv.close()


async def test_chunked_layers_reassemble() -> None:
    send, recv, got, target = await pair(chunk_bytes=3 * 2 * HEADS * DIM * 4)  # ~3 tokens per frame
    recv.start_load_kv(spec("c"))
    send.start_save("c", target, LAYERS)
    for i in range(LAYERS):
        send.save_kv_layer("c", i, *kv(i))
    await send.wait_for_save("c")
    await recv.wait_for_load("c", timeout=5)
    assert all(torch.equal(got[("c", i)][0], kv(i)[0]) for i in range(LAYERS))
    await send.close()
    await recv.close()


async def test_unknown_request_is_refused_without_retry() -> None:
    send, recv, _, target = await pair()
    send.start_save("nobody", target, LAYERS)
    send.save_kv_layer("nobody", 0, *kv(0))
    with pytest.raises(TransferError) as e:
        await send.wait_for_save("nobody")
    assert e.value.code == ErrorCode.UNKNOWN_REQUEST
    await send.close()
    await recv.close()


async def test_shape_mismatch_fails_the_load() -> None:
    send, recv, _, target = await pair()
    recv.start_load_kv(LoadSpec("m", LAYERS, TOKENS, HEADS, DIM * 2))
    send.start_save("m", target, LAYERS)
    send.save_kv_layer("m", 0, *kv(0))
    with pytest.raises(TransferError):
        await send.wait_for_save("m")
    with pytest.raises(TransferError):
        await recv.wait_for_load("m", timeout=5)
    await send.close()
    await recv.close()


async def test_wrong_secret_peer_is_rejected_and_server_keeps_serving() -> None:
    send, recv, got, target = await pair()
    recv.start_load_kv(spec("ok"))
    recv.start_load_kv(spec("evil"))
    evil = TCPConnector(b"b" * 32, TransferOptions())
    evil.start_save("evil", target, LAYERS)
    evil.save_kv_layer("evil", 0, *kv(0))
    with pytest.raises(TransferError):
        await evil.wait_for_save("evil")
    assert ("evil", 0) not in got
    assert recv.stats.frames_rejected >= 1
    send.start_save("ok", target, LAYERS)
    for i in range(LAYERS):
        send.save_kv_layer("ok", i, *kv(i))
    await send.wait_for_save("ok")
    await recv.wait_for_load("ok", timeout=5)
    for c in (send, recv, evil):
        await c.close()


async def test_garbage_and_truncated_frames_only_drop_their_connection() -> None:
    seen: list[Frame] = []

    async def handler(f: Frame) -> ErrorCode:
        seen.append(f)
        return ErrorCode.OK

    server = KVServer(SECRET, handler, frame_timeout=0.5)
    port = await server.start()
    # garbage instead of a handshake: closed without a word (no key to sign one with)
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 40)
    await w.drain()
    assert await closed(r)
    w.close()
    assert server.stats.frames_rejected == 1
    # truncated: an authenticated peer sends half a frame, then stalls (frame_timeout) — rejected, not hung
    frame = codec.encode_layer("t", 0, 1, *kv(0))
    chan = await open_channel("127.0.0.1", port, SECRET)
    data = b"".join(seal_frame(frame, chan.keys.send, 0))
    await chan.conn.send([data[: len(data) // 2]])
    reply = await asyncio.wait_for(chan.read_frame(), 5)
    assert reply.kind == Kind.ACK and reply.status == ErrorCode.TRUNCATED
    chan.close()
    # a good frame still goes through
    chan = await open_channel("127.0.0.1", port, SECRET)
    await chan.send(frame)
    reply = await asyncio.wait_for(chan.read_frame(), 5)
    assert reply.status == ErrorCode.OK and len(seen) == 1
    chan.close()
    await server.close()


async def test_retry_after_dropped_connection_then_success() -> None:
    drops = {"left": 1}
    got: list[int] = []

    async def handler(f: Frame) -> ErrorCode:
        got.append(f.layer)
        return ErrorCode.OK

    server = KVServer(SECRET, handler)
    orig = server._serve

    async def flaky(conn: Conn) -> None:
        if drops["left"]:
            drops["left"] -= 1
            conn.close()  # the receiver "dies" before reading anything
            return
        await orig(conn)

    server._serve = flaky  # type: ignore[method-assign]
    port = await server.start()
    box = Outbox("127.0.0.1", port, SECRET, timeout=10, max_retries=2)
    for i in range(LAYERS):
        box.put(codec.encode_layer("x", i, LAYERS, *kv(i)))
    await box.wait()
    assert box.attempts == 1 and sorted(set(got)) == list(range(LAYERS))
    await server.close()


async def test_no_receiver_fails_within_bounded_retries() -> None:
    # grab a free port, then close it so nothing listens
    srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    srv.close()
    await srv.wait_closed()
    box = Outbox("127.0.0.1", port, SECRET, timeout=10, max_retries=2)
    box.put(codec.encode_layer("y", 0, 1, *kv(0)))
    with pytest.raises(TransferError):
        await box.wait()
    assert box.attempts == 3


async def test_silent_receiver_times_out() -> None:
    async def hang(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)

    srv = await asyncio.start_server(hang, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    box = Outbox("127.0.0.1", port, SECRET, timeout=0.5, max_retries=1)
    box.put(codec.encode_layer("z", 0, 1, *kv(0)))
    with pytest.raises(TransferError, match="timed out"):
        await box.wait()
    srv.close()


async def test_abort_frame_fails_the_load() -> None:
    send, recv, _, target = await pair()
    recv.start_load_kv(spec("ab"))
    send.start_save("ab", target, LAYERS)
    send.save_kv_layer("ab", 0, *kv(0))
    await recv.wait_for_layer_load("ab", 0)
    await send.abort_save("ab")
    with pytest.raises(TransferError, match="aborted"):
        await recv.wait_for_load("ab", timeout=5)
    await send.close()
    await recv.close()
