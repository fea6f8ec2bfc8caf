"""NIXL from cache blocks to cache blocks (nixl_direct.py): both sides register their cache, float layers are
READ from the sender's blocks straight into the receiver's, with different block sizes on the two sides; the
MAC is checked where the bytes land; a READ in flight holds the blocks it writes until it ends."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from pdcluster.worker.transfer import nixl_direct, nixl_wire
from pdcluster.worker.transfer import options as transfer_options
from pdcluster.worker.transfer.channel import TransferError
from pdcluster.worker.transfer.connector import LoadSpec, TransferTarget
from pdcluster.worker.transfer.nixl_agent import availability
from pdcluster.worker.transfer.options import TransferOptions
from tests.transfer.kvsink import Sink

SECRET = b"d" * 32
LAYERS, TOKENS, HEADS, DIM = 3, 40, 2, 8
ROW = HEADS * DIM * 4  # bytes of one token's K (or V), fp32


# ---------------------------------------------------------------- pure pieces
def test_pair_cuts_both_sides_at_every_boundary() -> None:
    local = [(1000, 64), (5000, 64)]  # blocks of 64 bytes here
    remote = [(0, 32), (100, 48), (300, 48)]  # blocks of another size there
    lo, re = nixl_direct.pair(local, remote)
    assert lo == [(1000, 32), (1032, 32), (5000, 16), (5016, 48)]
    assert re == [(0, 32), (100, 32), (132, 16), (300, 48)]
    with pytest.raises(ValueError):
        nixl_direct.pair([(0, 10)], [(0, 11)])


def test_segmented_descriptor_round_trips_and_bad_ones_are_refused() -> None:
    segs = ((4096, 100), (9000, 28))
    d = nixl_wire.Descriptor(4096, 128, 0, b"s" * 16, b"t" * 16, "agent", b"meta", segs)
    got = nixl_wire.unpack(d.pack())
    assert got == d and got.parts == segs
    one = nixl_wire.Descriptor(4096, 128, 0, b"s" * 16, b"t" * 16, "agent", b"meta")
    assert nixl_wire.unpack(one.pack()).parts == ((4096, 128),)
    packed = d.pack()
    for bad in (packed[:-1], packed + b"\0", packed[:-16], packed[:-32] + b"\0\0\0\0"):
        with pytest.raises(nixl_wire.DescriptorError):
            nixl_wire.unpack(bad)
    for wrong in (((4096, 100), (9000, 27)), ((4000, 100), (9000, 28)), ((4096, 128), (9000, 0))):
        with pytest.raises(nixl_wire.DescriptorError):
            nixl_wire.Descriptor(4096, 128, 0, b"s" * 16, b"t" * 16, "agent", b"meta", wrong).pack()
    many = tuple((4096 + i, 1) for i in range(nixl_wire.MAX_SEGMENTS + 1))
    with pytest.raises(nixl_wire.DescriptorError):
        nixl_wire.Descriptor(4096, len(many), 0, b"s" * 16, b"t" * 16, "a", b"m", many).pack()


def test_mac_of_pieces_is_the_mac_of_their_join() -> None:
    data = bytes(range(256)) * 9
    pieces = [memoryview(data)[:7], memoryview(data)[7:1000], memoryview(data)[1000:]]
    assert nixl_wire.mac(SECRET, b"s" * 16, "r", 1, 0, data) == nixl_wire.mac(SECRET, b"s" * 16, "r", 1, 0, pieces)


async def test_settle_waits_for_every_read_of_the_request() -> None:
    inflight = nixl_direct.Inflight()
    inflight.begin("a")
    inflight.begin("a")
    inflight.begin("b")
    assert await inflight.settle("c", 0.01)
    assert not await inflight.settle("a", 0.01)
    threading.Timer(0.05, inflight.end, ("a",)).start()
    threading.Timer(0.1, inflight.end, ("a",)).start()
    assert await inflight.settle("a", 5)
    assert inflight.count() == 1 and inflight.count("b") == 1


# ---------------------------------------------------------------- two connectors over UCX
AVAILABLE = availability()
needs_nixl = pytest.mark.skipif(not AVAILABLE.ok, reason=AVAILABLE.reason)


class Cache:
    """A side's float cache: `[LAYERS, 2, blocks * block, HEADS, DIM]`, its token order scattered over blocks
    in reverse (slots of token t: block `blocks - 1 - t // block`), so a range lies in many pieces."""

    def __init__(self, block: int, fill: bool) -> None:
        self.block, self.blocks = block, -(-TOKENS // block)
        self.kv = torch.zeros(LAYERS, 2, self.blocks * block, HEADS, DIM)
        self.np = self.kv.numpy()
        if fill:
            for layer in range(LAYERS):
                k, v = kv(layer)
                for t in range(TOKENS):
                    s = self.slot(t)
                    self.kv[layer, 0, s], self.kv[layer, 1, s] = k[t], v[t]

    def slot(self, t: int) -> int:
        return (self.blocks - 1 - t // self.block) * self.block + t % self.block

    def views(self, layer: int, start: int, n: int) -> list[memoryview]:
        """K's runs of consecutive slots, then V's (what the engine's slot_views gives)."""
        out = []
        for i in range(2):
            t = start
            while t < start + n:
                run = min(start + n, (t // self.block + 1) * self.block) - t
                s = self.slot(t)
                out.append(memoryview(self.np[layer, i, s:s + run]).cast("B"))
                t += run
        return out

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor([self.slot(t) for t in range(TOKENS)])
        return self.kv[layer, 0, idx], self.kv[layer, 1, idx]


def kv(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + layer)
    return torch.randn(TOKENS, HEADS, DIM, generator=g), torch.randn(TOKENS, HEADS, DIM, generator=g)


async def direct_pair(recv_block: int = 16, register_recv: bool = True, integrity: str = "mac"
                      ) -> tuple[Any, Any, Cache, Cache, Sink, TransferTarget]:
    from pdcluster.worker.transfer.nixl_connector import NixlConnector

    src, dst, sink = Cache(8, fill=True), Cache(recv_block, fill=False), Sink()

    def destination(rid: str, layer: int, start: int, n: int, dtype: torch.dtype) -> Any:
        return (dst.views(layer, start, n), lambda: None) if dtype == torch.float32 else None

    send = NixlConnector(SECRET, TransferOptions(), staging_bytes=1 << 20)
    recv = NixlConnector(SECRET, TransferOptions(integrity=integrity), staging_bytes=1 << 20, importer=sink,
                         destination=destination)
    send.register_cache([src.kv])
    if register_recv:
        recv.register_cache([dst.kv])
    port = await recv.listen()
    return send, recv, src, dst, sink, TransferTarget("127.0.0.1", port)


def save_all(send: Any, src: Cache, rid: str, layers: range = range(LAYERS)) -> None:
    for layer in layers:
        assert send.save_kv_views(rid, layer, src.views(layer, 0, TOKENS), token_start=0, num_tokens=TOKENS,
                                  kv_heads=HEADS, head_dim=DIM, dtype=torch.float32)


@needs_nixl
@pytest.mark.parametrize("recv_block", [16, 5])
async def test_layers_go_cache_to_cache_exact_across_block_sizes(recv_block: int) -> None:
    send, recv, src, dst, sink, target = await direct_pair(recv_block)
    for rid in ("warm", "r"):  # the first adds the sender's agent (thread path), the second polls on the loop
        dst.kv.zero_()
        recv.start_load_kv(LoadSpec(rid, LAYERS, TOKENS, HEADS, DIM))
        send.start_save(rid, target, LAYERS)
        save_all(send, src, rid)
        res = await send.wait_for_save(rid)
        await recv.wait_for_load(rid, timeout=10)
        recv.finish_load(rid)
        for layer in range(LAYERS):
            k, v = dst.read(layer)
            assert torch.equal(k, kv(layer)[0]) and torch.equal(v, kv(layer)[1])
        assert res.bytes == LAYERS * TOKENS * 2 * ROW
    assert not sink.parts  # nothing went through the importer: the bytes landed in the cache
    assert send.direct_layers == [2 * LAYERS, 0] and recv.direct_layers == [0, 2 * LAYERS]
    r, s = recv.registrations(), send.registrations()
    assert (r["staging_regions"], s["staging_regions"], r["reads_in_flight"], s["outgoing"]) == (0, 0, 0, 0)
    await send.close()
    await recv.close()


@needs_nixl
async def test_a_receiver_without_a_registered_cache_reads_into_staging() -> None:
    """The sender's blocks still go without a gather; the receiver READs them into staging and imports."""
    send, recv, src, dst, sink, target = await direct_pair(register_recv=False)
    recv.start_load_kv(LoadSpec("s", LAYERS, TOKENS, HEADS, DIM))
    send.start_save("s", target, LAYERS)
    save_all(send, src, "s")
    await send.wait_for_save("s")
    await recv.wait_for_load("s", timeout=10)
    for layer in range(LAYERS):
        assert torch.equal(sink[("s", layer)][0], kv(layer)[0]) and torch.equal(sink[("s", layer)][1], kv(layer)[1])
    assert recv.direct_layers == [0, 0] and recv.registrations()["staging_regions"] == 0
    await send.close()
    await recv.close()


@needs_nixl
async def test_blocks_changed_after_the_mac_fail_the_load() -> None:
    """The sender's blocks are overwritten between the MAC and the READ (blocks reused after an abort, or a
    peer on the fabric): the receiver refuses the layer, and the load fails."""
    send, recv, src, dst, sink, target = await direct_pair()
    recv.start_load_kv(LoadSpec("t", LAYERS, TOKENS, HEADS, DIM))
    send.start_save("t", target, LAYERS)
    orig = send.save_kv_views

    def then_overwrite(*a: Any, **kw: Any) -> bool:
        ok = orig(*a, **kw)
        src.kv[a[1]].add_(1.0)  # after the MAC, before the receiver READs
        return ok

    send.save_kv_views = then_overwrite
    save_all(send, src, "t", range(1))
    with pytest.raises(TransferError, match="UNAUTHENTICATED"):
        await send.wait_for_save("t")
    with pytest.raises(TransferError, match="MAC"):
        await recv.wait_for_load("t", timeout=5)
    recv.cancel_load("t")
    assert await recv.settle("t", 5) and recv.registrations()["reads_in_flight"] == 0
    await send.close()
    await recv.close()


@needs_nixl
@pytest.mark.parametrize("small", [True, False])
async def test_cancel_waits_for_a_read_in_flight_before_the_blocks_are_freed(monkeypatch: pytest.MonkeyPatch,
                                                                              small: bool) -> None:
    """A load cancelled while a READ into its blocks is in flight: `settle` (what the worker awaits before
    it frees the reservation) returns only once that READ has ended, on the loop's path and the thread's."""
    from pdcluster.worker.transfer import nixl_connector

    send, recv, src, dst, sink, target = await direct_pair()
    recv.start_load_kv(LoadSpec("warm", LAYERS, TOKENS, HEADS, DIM))  # adds the sender's agent first
    send.start_save("warm", target, LAYERS)
    save_all(send, src, "warm")
    await send.wait_for_save("warm")
    await recv.wait_for_load("warm", timeout=10)
    recv.finish_load("warm")
    if not small:
        monkeypatch.setattr(nixl_connector, "INLINE_MAX", 0)
    gate, entered = threading.Event(), threading.Event()
    name = "aread_segments" if small else "read_segments"
    real = getattr(recv.agent, name)

    if small:
        async def held(*a: Any, **kw: Any) -> None:
            entered.set()
            while not gate.is_set():
                await asyncio.sleep(0.005)
            await real(*a, **kw)
    else:
        def held(*a: Any, **kw: Any) -> None:  # type: ignore[misc]
            entered.set()
            gate.wait(10)
            real(*a, **kw)

    monkeypatch.setattr(recv.agent, name, held)
    recv.start_load_kv(LoadSpec("c", LAYERS, TOKENS, HEADS, DIM))
    send.start_save("c", target, LAYERS)
    save_all(send, src, "c", range(1))
    assert await asyncio.to_thread(entered.wait, 10)
    recv.cancel_load("c")
    settling = asyncio.ensure_future(recv.settle("c", 10))
    await asyncio.sleep(0.1)
    assert not settling.done(), "settle returned while a READ into the request's blocks was still in flight"
    gate.set()
    assert await settling
    assert recv.registrations()["reads_in_flight"] == 0
    await send.abort_save("c")
    await send.close()
    await recv.close()


@needs_nixl
@pytest.mark.parametrize("register_recv", [True, False])
async def test_a_timed_out_read_keeps_its_memory_until_it_has_drained(monkeypatch: pytest.MonkeyPatch,
                                                                      register_recv: bool) -> None:
    """A READ that times out may still land: the staging region it targets is not reused, and the cache
    blocks it targets are not settled, until the agent reports it ended (drained)."""
    from pdcluster.worker.transfer import nixl_connector

    monkeypatch.setattr(nixl_connector, "INLINE_MAX", 0)  # the reader-thread path
    send, recv, src, dst, sink, target = await direct_pair(register_recv=register_recv)
    draining: list[Any] = []

    def timed_out(peer: str, local: Any, remote: Any, dev: int, timeout: float, on_end: Any) -> None:
        draining.append(on_end)  # the drain thread would call this once the READ really ends
        raise TimeoutError("nixl READ timed out")

    monkeypatch.setattr(recv.agent, "read_segments", timed_out)
    recv.start_load_kv(LoadSpec("x", LAYERS, TOKENS, HEADS, DIM))
    send.start_save("x", target, LAYERS)
    save_all(send, src, "x", range(1))
    while not draining:
        await asyncio.sleep(0.01)
    await send.abort_save("x")
    recv.cancel_load("x")
    regs = recv.registrations()
    if register_recv:
        assert regs["reads_in_flight"] >= 1 and not await recv.settle("x", 0.05)
    else:
        assert regs["staging_regions"] >= 1  # not handed to another layer while the READ may land
    for end in draining:
        end()
    assert await recv.settle("x", 1)
    regs = recv.registrations()
    assert (regs["reads_in_flight"], regs["staging_regions"]) == (0, 0), regs
    await send.close()
    await recv.close()


def test_hold_frees_once_every_party_dropped() -> None:
    freed: list[int] = []
    hold = nixl_direct.Hold(2, lambda: freed.append(1))
    hold.drop()
    assert not freed
    hold.drop()
    assert freed == [1]


@needs_nixl
async def test_int8_compression_quantizes_the_views_piece_by_piece_into_staging(monkeypatch: pytest.MonkeyPatch
                                                                                ) -> None:
    """int8 on the wire over NIXL from the cache's views: quantized where the bytes lie, in pieces (each
    staged and READ as soon as it is quantized), the codes those of the whole layer's quantization."""
    from pdcluster.kernels import native
    from pdcluster.worker.transfer import chunking, codec
    from pdcluster.worker.transfer.nixl_connector import NixlConnector

    if not native.quant_ready():
        pytest.skip("no native int8 quantizer here (the views are gathered for the torch one instead)")
    monkeypatch.setattr(chunking, "PIPE_BYTES", 7 * 2 * HEADS * (DIM + 4))  # 7 tokens a piece: 6 pieces a layer
    src, sink = Cache(8, fill=True), Sink()
    send = NixlConnector(SECRET, TransferOptions(compression="int8"), staging_bytes=1 << 20)
    recv = NixlConnector(SECRET, TransferOptions(), staging_bytes=1 << 20, importer=sink)
    send.register_cache([src.kv])
    target = TransferTarget("127.0.0.1", await recv.listen())
    recv.start_load_kv(LoadSpec("q", LAYERS, TOKENS, HEADS, DIM))
    send.start_save("q", target, LAYERS)
    save_all(send, src, "q")
    res = await send.wait_for_save("q")
    await recv.wait_for_load("q", timeout=10)
    for layer in range(LAYERS):
        starts = sorted(t for (key, t, *_) in sink.raw if key == ("q", layer))
        assert starts == list(range(0, TOKENS, 7))
        for i, x in enumerate(kv(layer)):
            want_q, want_s = codec.quantize8(x)
            got_q = torch.cat([r[2 + i] for r in sorted(sink.raw, key=lambda r: r[1]) if r[0] == ("q", layer)])
            got_s = torch.cat([r[4][i] for r in sorted(sink.raw, key=lambda r: r[1]) if r[0] == ("q", layer)])
            assert torch.equal(got_q, want_q) and torch.equal(got_s, want_s)
    assert res.bytes == LAYERS * TOKENS * 2 * HEADS * (DIM + 4)  # codes and scales, not fp32
    assert send.registrations()["staging_regions"] == 0 and recv.registrations()["staging_regions"] == 0
    await send.close()
    await recv.close()


@needs_nixl
async def test_fabric_integrity_sends_and_checks_no_mac_and_a_mac_receiver_says_why_it_refuses() -> None:
    """--kv-transfer-integrity fabric: no MAC computed or checked (the bytes are trusted as they land, on
    an isolated fabric); a receiver still on `mac` refuses those layers and names the setting."""
    from pdcluster.worker.transfer.nixl_connector import NixlConnector

    with pytest.raises(ValueError, match="integrity"):
        NixlConnector(SECRET, TransferOptions(integrity="none"), staging_bytes=1 << 16)
    macs: list[int] = []
    real_mac = nixl_wire.mac

    def counted(*a: Any, **kw: Any) -> bytes:
        macs.append(1)
        return real_mac(*a, **kw)

    for recv_integrity in ("fabric", "mac"):
        send, recv, src, dst, sink, target = await direct_pair(integrity=recv_integrity)
        send.integrity = "fabric"
        orig = nixl_wire.mac
        nixl_wire.mac = counted  # type: ignore[assignment]
        try:
            recv.start_load_kv(LoadSpec("f", LAYERS, TOKENS, HEADS, DIM))
            send.start_save("f", target, LAYERS)
            save_all(send, src, "f")
            if recv_integrity == "fabric":
                await send.wait_for_save("f")
                await recv.wait_for_load("f", timeout=10)
                for layer in range(LAYERS):
                    assert torch.equal(dst.read(layer)[0], kv(layer)[0])
                assert not macs  # neither side hashed a byte
            else:
                with pytest.raises(TransferError, match="UNAUTHENTICATED"):
                    await send.wait_for_save("f")
                with pytest.raises(TransferError, match="kv-transfer-integrity fabric"):
                    await recv.wait_for_load("f", timeout=5)
                recv.cancel_load("f")
        finally:
            nixl_wire.mac = orig  # type: ignore[assignment]
        assert transfer_options.INTEGRITY == ("mac", "fabric")
        await send.close()
        await recv.close()
