"""Float layers received straight into the receiver's cache (placing.py): same bytes as the copy path, no
importer call, and a tampered, truncated or cancelled placed frame never completes a load."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pdcluster.kernels import quantize_kv
from pdcluster.worker.transfer import channel
from pdcluster.worker.transfer.connector import LoadSpec, TCPConnector, TransferError, TransferTarget
from pdcluster.worker.transfer.frame import Frame, FrameKey, seal_frame
from pdcluster.worker.transfer.options import TransferOptions
from tests.transfer.kvsink import Sink

SECRET = b"p" * 32
LAYERS, TOKENS, HEADS, DIM = 3, 40, 2, 8


def kv(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(layer)
    return torch.randn(TOKENS, HEADS, DIM, generator=g), torch.randn(TOKENS, HEADS, DIM, generator=g)


class Cache:
    """A float cache whose layers the transport may write in place: K and V of every layer, contiguous."""

    def __init__(self) -> None:
        self.kv = torch.zeros(LAYERS, 2, TOKENS, HEADS, DIM)
        self.asked: list[tuple[int, int, int]] = []
        self.released = 0

    def destination(self, rid: str, layer: int, start: int, n: int, dtype: torch.dtype) -> Any:
        self.asked.append((layer, start, n))
        if dtype != torch.float32:
            return None
        views = [memoryview(self.kv[layer, i, start:start + n].numpy()).cast("B") for i in range(2)]
        return views, self._release

    def _release(self) -> None:
        self.released += 1


async def placed_pair(chunk_bytes: int = 64 << 20) -> tuple[TCPConnector, TCPConnector, Sink, Cache, TransferTarget]:
    sink, cache = Sink(), Cache()
    recv = TCPConnector(SECRET, TransferOptions(), importer=sink, destination=cache.destination)
    port = await recv.listen()
    send = TCPConnector(SECRET, TransferOptions(), chunk_bytes=chunk_bytes)
    return send, recv, sink, cache, TransferTarget("127.0.0.1", port)


@pytest.mark.parametrize("chunk_bytes", [64 << 20, 2048])  # whole layers, and layers cut in token ranges
async def test_float_layers_land_in_the_cache_without_the_importer(chunk_bytes: int) -> None:
    send, recv, sink, cache, target = await placed_pair(chunk_bytes)
    recv.start_load_kv(LoadSpec("r", LAYERS, TOKENS, HEADS, DIM))
    send.start_save("r", target, LAYERS)
    for i in range(LAYERS):
        send.save_kv_layer("r", i, *kv(i))
    await send.wait_for_save("r")
    await recv.wait_for_load("r", timeout=10)
    for i in range(LAYERS):
        k, v = kv(i)
        assert torch.equal(cache.kv[i, 0], k) and torch.equal(cache.kv[i, 1], v)
    assert len(sink) == 0  # nothing went through the importer
    assert cache.released == len(cache.asked) >= LAYERS
    assert recv.finish_load("r")[0] == LAYERS * 2 * TOKENS * HEADS * DIM * 4
    await send.close()
    await recv.close()


async def test_codes_and_other_dtypes_still_go_through_the_importer() -> None:
    send, recv, sink, cache, target = await placed_pair()
    recv.start_load_kv(LoadSpec("c", LAYERS, TOKENS, HEADS, DIM))
    send.start_save("c", target, LAYERS)
    for i in range(LAYERS):
        k, v = kv(i)
        if i == 0:  # an int8 cache's codes: not placeable (scales), imported as before
            (qk, sk), (qv, sv) = quantize_kv(k, 8), quantize_kv(v, 8)
            send.save_kv_layer("c", i, qk, qv, scales=(sk, sv))
        else:  # fp16: the destination declines it
            send.save_kv_layer("c", i, k.half(), v.half())
    await send.wait_for_save("c")
    await recv.wait_for_load("c", timeout=10)
    assert sorted(layer for _, layer in sink.parts) == list(range(LAYERS))
    assert not cache.kv.any()
    await send.close()
    await recv.close()


def _tamper_payload(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender's channel seals each data frame, then a byte of its payload changes on the way."""

    def seal(frame: Frame, key: FrameKey, seq: int, limits: Any = None) -> list[Any]:
        parts = seal_frame(frame, key, seq) if limits is None else seal_frame(frame, key, seq, limits)
        if frame.payload and len(parts) > 3:
            bad = bytearray(parts[2])
            bad[len(bad) // 2] ^= 0x40
            parts[2] = bytes(bad)
        return parts

    monkeypatch.setattr(channel, "seal_frame", seal)


async def test_a_tampered_placed_payload_fails_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    send, recv, _, cache, target = await placed_pair()
    recv.start_load_kv(LoadSpec("t", LAYERS, TOKENS, HEADS, DIM))
    _tamper_payload(monkeypatch)
    send.start_save("t", target, LAYERS)
    send.save_kv_layer("t", 0, *kv(0))
    with pytest.raises(TransferError):
        await send.wait_for_save("t")
    with pytest.raises(TransferError, match="failed its tag"):
        await recv.wait_for_load("t", timeout=10)
    assert cache.released == len(cache.asked) == 1  # the claim was given back
    await send.close()
    await recv.close()


async def test_a_connection_cut_mid_payload_unclaims_the_range_and_a_resend_completes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    send, recv, _, cache, target = await placed_pair()
    recv.start_load_kv(LoadSpec("d", LAYERS, TOKENS, HEADS, DIM))
    real = channel.Conn.recv_into_parts
    cuts = {"left": 1}

    async def cut(self: channel.Conn, views: Any, alive: Callable[[], bool] = lambda: True) -> None:
        if cuts["left"]:
            cuts["left"] -= 1
            self.close()  # the connection breaks with the payload half in
            raise channel.Closed(0)
        await real(self, views, alive)

    monkeypatch.setattr(channel.Conn, "recv_into_parts", cut)
    send.start_save("d", target, LAYERS)
    for i in range(LAYERS):
        send.save_kv_layer("d", i, *kv(i))
    await send.wait_for_save("d")  # the sender reconnects and resends what was not ACKed
    await recv.wait_for_load("d", timeout=10)
    for i in range(LAYERS):
        assert torch.equal(cache.kv[i, 0], kv(i)[0])
    assert cache.released == len(cache.asked)
    await send.close()
    await recv.close()


async def test_nothing_is_written_into_a_cancelled_loads_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """cancel_load runs before the owner frees the blocks: the receive stops writing there at once."""
    send, recv, _, cache, target = await placed_pair()
    recv.start_load_kv(LoadSpec("x", LAYERS, TOKENS, HEADS, DIM))
    real = channel.Conn.recv_into_parts
    seen: list[bool] = []

    async def cancel_first(self: channel.Conn, views: Any, alive: Callable[[], bool] = lambda: True) -> None:
        recv.cancel_load("x")  # e.g. the reaper, while this payload is on its way
        seen.append(alive())
        await real(self, views, alive)

    monkeypatch.setattr(channel.Conn, "recv_into_parts", cancel_first)
    send.start_save("x", target, LAYERS)
    send.save_kv_layer("x", 0, *kv(0))
    with pytest.raises(TransferError):
        await send.wait_for_save("x")
    assert seen == [False] and not cache.kv.any()
    assert cache.released == len(cache.asked) == 1
    await send.close()
    await recv.close()


async def test_recv_into_parts_fills_views_in_order() -> None:
    got = asyncio.get_running_loop().create_future()

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(bytes(range(200)))
        await w.drain()
        await got
        w.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    conn = await channel.Conn.connect("127.0.0.1", server.sockets[0].getsockname()[1])
    bufs = [bytearray(n) for n in (7, 0, 120, 73)]
    await conn.recv_into_parts([memoryview(b) for b in bufs])
    assert b"".join(bufs) == bytes(range(200))
    got.set_result(None)
    conn.close()
    server.close()
