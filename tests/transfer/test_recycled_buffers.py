"""Pooled memory on the TCP path (bufpool.py, lending.py) and the wire quantizer (codec.quantize8): memory is
reused only once nothing reads it, and the bytes that arrive are the bytes that were sent."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from pdcluster.kernels.kv_quant import quantize_kv
from pdcluster.worker.transfer import codec
from pdcluster.worker.transfer.bufpool import MIN_POOLED, BufferPool
from pdcluster.worker.transfer.connector import LoadSpec, TCPConnector, TransferTarget
from pdcluster.worker.transfer.frame import (
    ErrorCode,
    Frame,
    FrameError,
    FrameKey,
    Gathered,
    Kind,
    decode_frame,
    encode_frame,
)
from pdcluster.worker.transfer.lending import Lender
from pdcluster.worker.transfer.options import TransferOptions
from tests.transfer.kvsink import Sink

SECRET = b"r" * 32
HEADS, DIM = 4, 64


def test_pool_reuses_a_block_only_after_it_is_given_back() -> None:
    pool = BufferPool(1 << 30)
    a, b = pool.take(1 << 20), pool.take(1 << 20)
    assert a.obj is not b.obj and pool.reused == 0
    pool.give(a)
    c = pool.take(1 << 20)
    assert c.obj is a.obj and pool.reused == 1
    d = pool.take(1 << 20).obj
    assert d is not b.obj and d is not c.obj  # nothing given back: a new block


def test_pool_refuses_a_double_give_and_keeps_at_most_max_bytes() -> None:
    pool = BufferPool(3 << 20)
    views = [pool.take(1 << 20) for _ in range(5)]
    pool.give(views[0])
    with pytest.raises(RuntimeError, match="twice"):
        pool.give(views[0])
    for v in views[1:]:
        pool.give(v)
    assert pool.kept_bytes <= 3 << 20


def test_pool_does_not_lend_a_huge_block_for_a_small_body_nor_keep_small_ones() -> None:
    pool = BufferPool(1 << 30)
    pool.give(pool.take(64 << 20))
    assert len(pool.take(1 << 20)) == 1 << 20 and pool.reused == 0  # 64 MiB kept for bodies that need it
    small = pool.take(MIN_POOLED - 1)
    pool.give(small)
    assert pool.kept_bytes == 64 << 20


def test_lender_gives_back_only_when_every_frame_of_the_save_is_acked() -> None:
    lender = Lender(1 << 30)
    lender.open("r")
    buf = lender.lend("r", 1 << 20)
    lease = lender.take(buf)
    frames = [Frame(kind=Kind.LAYER, request_id="r", layer=0, token_start=t) for t in (0, 1)]
    lender.attach("r", lease, frames, uses_buffer=True)
    lender.acked(frames[0])
    assert lender.pool.kept_bytes == 0 and lender.held == 1  # frame 1 may still be resent from these bytes
    lender.acked(frames[1])
    assert lender.pool.kept_bytes >= 1 << 20 and lender.held == 0


def test_lender_keeps_an_aborted_saves_memory_out_of_the_pool() -> None:
    lender = Lender(1 << 30)
    lender.open("r")
    lease = lender.take(lender.lend("r", 1 << 20))
    frame = Frame(kind=Kind.LAYER, request_id="r")
    lender.attach("r", lease, [frame], uses_buffer=True)
    lender.forget("r")  # aborted: an in-flight send may still read the bytes
    lender.acked(frame)
    assert lender.pool.kept_bytes == 0 and lender.held == 0
    late = lender.take(lender.lend("r", 1 << 20))  # encoded after the abort
    lender.attach("r", late, [Frame(kind=Kind.LAYER, request_id="r")], uses_buffer=True)
    assert lender.held == 0 and lender.pool.kept_bytes == 0


@pytest.mark.parametrize("shape", [(3, 5, 64), (2, 2049, 8, 128), (1, 1, 2)])
def test_quantize8_matches_the_kernel_bit_for_bit(shape: tuple[int, ...]) -> None:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 3
    x.view(-1, shape[-1])[0] = 0.0  # an all-zero vector: scale 0, codes 0
    x.view(-1, shape[-1])[-1] = -0.0
    q0, s0 = quantize_kv(x, bits=8)
    q1, s1 = codec.quantize8(x)
    assert torch.equal(q0, q1)
    assert torch.equal(s0.view(torch.int32), s1.view(torch.int32))  # +0 scales, not -0


async def _send(send: TCPConnector, rid: str, port: int, kv: torch.Tensor, tokens: int) -> None:
    send.start_save(rid, TransferTarget("127.0.0.1", port), 1)
    buf = send.export_buffer(rid, 0, 0, kv.numel() * 4, quantized=False)
    assert buf is not None
    out = buf.view(torch.float32).view(kv.shape)
    out.copy_(kv)  # as the engine gathers into what the connector lends
    send.save_kv_layer(rid, 0, out[0], out[1])
    await send.wait_for_save(rid)


@pytest.mark.parametrize("compression", ["none", "int8"])
async def test_recycled_buffers_carry_every_transfer_intact(compression: str) -> None:
    """Several multi-frame transfers back to back through pooled export and receive memory: each arrives
    exactly, and the pools are actually reused (not a test that passes by allocating fresh memory)."""
    sink = Sink()
    recv = TCPConnector(SECRET, TransferOptions(), importer=sink)
    port = await recv.listen()
    send = TCPConnector(SECRET, TransferOptions(compression=compression), chunk_bytes=256 << 10)
    tokens = 600  # 1.2 MiB of fp32 K+V: several frames per layer
    try:
        for i in range(4):
            kv = torch.randn(2, tokens, HEADS, DIM, generator=torch.Generator().manual_seed(i))
            rid = f"r{i}"
            recv.start_load_kv(LoadSpec(rid, 1, tokens, HEADS, DIM))
            await _send(send, rid, port, kv, tokens)
            await recv.wait_for_load(rid, timeout=30)
            k, v = sink[(rid, 0)]
            tol = 0.05 if compression == "int8" else 0.0
            assert torch.allclose(k, kv[0], atol=tol) and torch.allclose(v, kv[1], atol=tol)
        assert recv.server is not None and recv.server.pool is not None and recv.server.pool.reused > 0
        assert send._lender.pool.reused > 0 and send._lender.held == 0
    finally:
        await send.close()
        await recv.close()


async def test_a_body_is_not_reused_while_its_import_is_still_running() -> None:
    """A slow (async) importer still reading its frame while later frames arrive: those frames must land in
    other memory. Fails if a body goes back to the pool before its handler returns."""
    seen: list[bool] = []
    expect: dict[int, torch.Tensor] = {}

    async def slow(rid: str, layer: int, k: torch.Tensor, v: torch.Tensor, *, token_start: int = 0,
                   scales: object = None) -> None:
        before = k.clone()
        await asyncio.sleep(0.2)  # later frames of this connection are received meanwhile
        seen.append(torch.equal(k, before) and torch.equal(k, expect[token_start]))

    recv = TCPConnector(SECRET, TransferOptions(), importer=slow)
    port = await recv.listen()
    send = TCPConnector(SECRET, TransferOptions(), chunk_bytes=256 << 10)
    tokens = 1200
    kv = torch.randn(2, tokens, HEADS, DIM, generator=torch.Generator().manual_seed(7))
    step = (256 << 10) // (2 * HEADS * DIM * 4)
    expect.update({s: kv[0, s:s + step] for s in range(0, tokens, step)})
    try:
        for i in range(2):
            recv.start_load_kv(LoadSpec(f"s{i}", 1, tokens, HEADS, DIM))
            await _send(send, f"s{i}", port, kv, tokens)
            await recv.wait_for_load(f"s{i}", timeout=30)
        assert len(seen) == 2 * len(expect) and all(seen)
    finally:
        await send.close()
        await recv.close()


def test_a_gathered_payload_is_the_joined_bytes_on_the_wire_and_still_authenticated() -> None:
    """K and V of a token range of a bigger export are sent as two parts (no join): the frame on the wire,
    tags included, must be byte for byte the joined one, and tampering must still fail its tag."""
    kv = torch.randn(2, 300, HEADS, DIM, generator=torch.Generator().manual_seed(3))
    f = codec.encode_layer("g", 0, 1, kv[0, 100:200], kv[1, 100:200], token_start=100)
    assert isinstance(f.payload, Gathered) and len(f.payload.parts) == 2
    key = FrameKey(b"k" * 32)
    wire = encode_frame(f, key, 5)
    assert wire == encode_frame(replace(f, payload=bytes(f.payload)), key, 5)
    k, v = codec.decode_layer(decode_frame(wire, key, 5))
    assert torch.equal(k, kv[0, 100:200]) and torch.equal(v, kv[1, 100:200])
    bad = bytearray(wire)
    bad[len(bad) // 2] ^= 1
    with pytest.raises(FrameError) as e:
        decode_frame(bad, key, 5)
    assert e.value.code == ErrorCode.UNAUTHENTICATED
    with pytest.raises(FrameError):  # the same frame at another position (a replay) fails too
        decode_frame(wire, key, 6)


async def test_transfers_to_one_receiver_reuse_one_authenticated_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second transfer takes the first one's connection (no new handshake), its frames still pass the
    receiver's tag checks (the sequence numbers continue), and a kept connection the receiver has closed
    meanwhile is replaced without spending a retry (max_retries=0 would fail otherwise)."""
    from pdcluster.worker.transfer import chancache

    sink = Sink()
    recv = TCPConnector(SECRET, TransferOptions(), importer=sink)
    port = await recv.listen()
    send = TCPConnector(SECRET, TransferOptions(max_retries=0))
    tokens = 40
    try:
        for i in range(3):
            kv = torch.randn(2, tokens, HEADS, DIM, generator=torch.Generator().manual_seed(i))
            recv.start_load_kv(LoadSpec(f"c{i}", 1, tokens, HEADS, DIM))
            await _send(send, f"c{i}", port, kv, tokens)
            await recv.wait_for_load(f"c{i}", timeout=30)
            assert torch.equal(sink[(f"c{i}", 0)][0], kv[0])
        assert send._channels.reused == 2
        assert recv.server is not None and len(recv.server._conns) == 1  # one connection served all three
        for t in list(recv.server._conns):  # the receiver drops it (restart, idle timeout)
            t.cancel()
        await asyncio.sleep(0.1)
        # ... and the check before reuse misses it (the close is still on its way): the send fails on it
        monkeypatch.setattr(chancache, "idle_and_open", lambda chan: True)
        recv.start_load_kv(LoadSpec("c3", 1, tokens, HEADS, DIM))
        await _send(send, "c3", port, kv, tokens)
        await recv.wait_for_load("c3", timeout=30)
        assert torch.equal(sink[("c3", 0)][0], kv[0])
        assert send._channels.reused == 3
    finally:
        await send.close()
        await recv.close()


async def test_a_kept_connection_is_closed_after_max_idle() -> None:
    from pdcluster.worker.transfer.chancache import ChannelCache, idle_and_open
    from pdcluster.worker.transfer.channel import open_channel

    recv = TCPConnector(SECRET, TransferOptions(), importer=Sink())
    port = await recv.listen()
    cache = ChannelCache(max_idle=0.2)
    try:
        chan = await open_channel("127.0.0.1", port, SECRET)
        assert idle_and_open(chan)
        cache.put("127.0.0.1", port, chan)
        await asyncio.sleep(0.4)  # expired: closed, not handed out
        assert cache.get("127.0.0.1", port) is None and chan.conn.sock.fileno() == -1
    finally:
        cache.close()
        await recv.close()
