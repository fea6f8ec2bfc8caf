"""The TCP backend's short paths (issue 12): a layer that needs no computing is framed on the caller's
thread (no hop through an encoder thread and back), int8 compression of a big layer leaves frame by frame
while the encoder quantizes the next range, and the bytes that arrive are still the bytes that were sent."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch

from pdcluster.kernels.kv_quant import quantize_kv
from pdcluster.worker.transfer import chunking, codec
from pdcluster.worker.transfer.connector import LoadSpec, TCPConnector, TransferTarget
from pdcluster.worker.transfer.options import TransferOptions
from pdcluster.worker.transfer.outbox import Outbox
from tests.transfer.kvsink import Sink

SECRET = b"f" * 32
HEADS, DIM = 4, 64


def _no_encoder(conn: TCPConnector) -> None:
    def refuse(*a: Any, **k: Any) -> Any:
        raise AssertionError("a layer that needs no computing went through the encoder thread")

    conn._encoder.submit = refuse  # type: ignore[method-assign]


async def _pair(compression: str = "none") -> tuple[TCPConnector, TCPConnector, Sink, TransferTarget]:
    sink = Sink()
    recv = TCPConnector(SECRET, TransferOptions(), importer=sink)
    port = await recv.listen()
    return TCPConnector(SECRET, TransferOptions(compression=compression)), recv, sink, TransferTarget("127.0.0.1", port)


@pytest.mark.parametrize("codes", [False, True])
async def test_a_float_or_codes_layer_is_framed_and_queued_on_the_loop_at_once(codes: bool) -> None:
    send, recv, sink, target = await _pair()
    _no_encoder(send)
    k, v = torch.randn(2, 9, HEADS, DIM).unbind(0)
    kw: dict[str, Any] = {}
    if codes:
        (k, sk), (v, sv) = quantize_kv(k, 8), quantize_kv(v, 8)
        kw["scales"] = (sk, sv)
    recv.start_load_kv(LoadSpec("r", 1, 9, HEADS, DIM))
    send.start_save("r", target, 1)
    send.save_kv_layer("r", 0, k, v, **kw)
    box = send._outboxes["r"][0]
    assert isinstance(box, Outbox) and len(box._order) == 1  # queued before save_kv_layer returned
    await send.wait_for_save("r")
    await recv.wait_for_load("r", timeout=10)
    (_, _, gk, gv, gs) = sink.raw[0]
    assert torch.equal(gk, k) and torch.equal(gv, v)
    if codes:
        assert gs is not None and torch.equal(gs[0], kw["scales"][0]) and torch.equal(gs[1], kw["scales"][1])
    await send.close()
    await recv.close()


async def test_a_layer_saved_from_another_thread_still_skips_the_encoder() -> None:
    send, recv, sink, target = await _pair()
    _no_encoder(send)
    k, v = torch.randn(2, 7, HEADS, DIM).unbind(0)
    recv.start_load_kv(LoadSpec("t", 2, 7, HEADS, DIM))
    send.start_save("t", target, 2)
    # the engine's thread: frames reach the loop in one hop, before anything the thread does next
    await asyncio.to_thread(lambda: [send.save_kv_layer("t", i, k + i, v - i) for i in range(2)])
    await send.wait_for_save("t")
    await recv.wait_for_load("t", timeout=10)
    for i in range(2):
        gk, gv = sink["t", i]
        assert torch.equal(gk, k + i) and torch.equal(gv, v - i)
    await send.close()
    await recv.close()


async def test_int8_compression_sends_each_range_while_the_next_is_quantized(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunking, "PIPE_BYTES", 4 * HEADS * (DIM + 4) * 2)  # 4 tokens of int8 wire per frame
    send, recv, sink, target = await _pair("int8")
    tokens = 16
    k, v = torch.randn(2, tokens, HEADS, DIM).unbind(0)
    events: list[tuple[str, int]] = []
    lock = threading.Lock()
    encode, put = codec.encode_layer, Outbox.put

    def slow_encode(*a: Any, **kw: Any) -> Any:
        frame = encode(*a, **kw)
        time.sleep(0.05)  # a quantizer slower than the wire: the first range must not wait for the last
        with lock:
            events.append(("encoded", frame.token_start))
        return frame

    def record_put(self: Outbox, frame: Any) -> None:
        with lock:
            events.append(("queued", frame.token_start))
        put(self, frame)

    monkeypatch.setattr(codec, "encode_layer", slow_encode)
    monkeypatch.setattr(Outbox, "put", record_put)
    recv.start_load_kv(LoadSpec("q", 1, tokens, HEADS, DIM))
    send.start_save("q", target, 1)
    send.save_kv_layer("q", 0, k, v)
    await send.wait_for_save("q")
    await recv.wait_for_load("q", timeout=10)
    assert [e for e in events if e[0] == "encoded"] == [("encoded", s) for s in (0, 4, 8, 12)]
    assert events.index(("queued", 0)) < events.index(("encoded", 12))  # on the wire before the last is built
    gk, gv = sink["q", 0]
    (qk, sk), (qv, sv) = quantize_kv(k, 8), quantize_kv(v, 8)  # per-vector scales: ranges = the whole layer
    assert torch.equal(gk, codec.to_float(qk, qv, (sk, sv))[0]) and torch.equal(gv, codec.to_float(qk, qv, (sk, sv))[1])
    await send.close()
    await recv.close()


async def test_a_big_layer_keeps_the_encoder_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past INLINE_MAX the hop is small next to the transfer, and the engine's thread stays free."""
    from pdcluster.worker.transfer import connector

    monkeypatch.setattr(connector, "INLINE_MAX", 1024)
    send, recv, sink, target = await _pair()
    used: list[int] = []
    submit = send._encoder.submit

    def counted(*a: Any, **kw: Any) -> Any:
        used.append(1)
        return submit(*a, **kw)

    send._encoder.submit = counted  # type: ignore[method-assign]
    k, v = torch.randn(2, 9, HEADS, DIM).unbind(0)  # 18 KiB of K+V > 1 KiB
    recv.start_load_kv(LoadSpec("b", 1, 9, HEADS, DIM))
    send.start_save("b", target, 1)
    send.save_kv_layer("b", 0, k, v)
    await send.wait_for_save("b")
    await recv.wait_for_load("b", timeout=10)
    assert used == [1] and torch.equal(sink["b", 0][0], k)
    await send.close()
    await recv.close()
