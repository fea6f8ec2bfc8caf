"""Head-range transfers in one process: cutting a save into ranges, writing a range into a paged cache in
any format, the receiver's checks of which ranges it accepts, and a route failing while another works."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdcluster.kernels.kv_quant import quantize_kv
from pdcluster.worker.engine.kv_cache import PagedKVCache
from pdcluster.worker.transfer.channel import TransferError
from pdcluster.worker.transfer.connector import LoadSpec, TCPConnector, TransferTarget
from pdcluster.worker.transfer.frame import Frame
from pdcluster.worker.transfer.head_slice import HeadRoute, slice_heads, write_heads
from pdcluster.worker.transfer.options import TransferOptions
from tests.transfer.kvsink import Sink

SECRET = b"s" * 32
T, H, D = 11, 4, 8


def kv(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g)


def test_slice_heads_is_free_for_all_heads_and_a_copy_otherwise() -> None:
    k, v = kv()
    s = (torch.rand(T, H), torch.rand(T, H))
    assert all(a is b for a, b in zip(slice_heads(k, v, s, 0, H)[:2], (k, v), strict=True))
    sk, sv, ss = slice_heads(k, v, s, 1, 2)
    assert sk.is_contiguous() and torch.equal(sk, k[:, 1:3]) and torch.equal(sv, v[:, 1:3])
    assert ss is not None and torch.equal(ss[1], s[1][:, 1:3])
    with pytest.raises(ValueError, match="outside the sender's 4 heads"):
        slice_heads(k, v, None, 3, 2)


def test_a_one_token_range_is_a_copy_too() -> None:
    """A save of one token: heads [0, 2) of a [1, 4, D] tensor are already contiguous, and `.contiguous()`
    returned the view itself, whose data_ptr is the export's. A NIXL sender keys the staging it lent the
    export by that pointer: the first route took the export's region as its own, freed it (size mismatch) and
    the second route read heads out of freed staging — wrong tokens on TP 1 -> 2 direct over NIXL."""
    k, v = torch.randn(1, H, D), torch.randn(1, H, D)
    for src in (0, 2):
        sk, sv, _ = slice_heads(k, v, None, src, 2)
        assert torch.equal(sk, k[:, src:src + 2]) and torch.equal(sv, v[:, src:src + 2])
        assert sk.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
        assert sv.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "int4"])
@pytest.mark.parametrize("wire", ["float", "int8"])
def test_write_heads_equals_writing_the_whole_layer(kv_dtype: str, wire: str) -> None:
    """Ranges written one by one (any wire format into any cache format) give the cache writing all heads
    at once gives: per-vector scales make a range's codes independent of the other heads."""
    k, v = kv(1)
    if wire == "int8":  # what arrives: int8 codes; the reference writes the values they stand for
        (qk, sk), (qv, sv) = quantize_kv(k, 8), quantize_kv(v, 8)
        from pdcluster.worker.transfer.codec import to_float

        k, v = to_float(qk, qv, (sk, sv))
    whole = PagedKVCache(1, 4, 8, H, D, kv_dtype=kv_dtype)
    parts = PagedKVCache(1, 4, 8, H, D, kv_dtype=kv_dtype)
    slots = torch.tensor([17, 3, 9, 30, 0, 8, 24, 25, 26, 5, 6])
    whole.write(0, k, v, slots)
    for start, n in [(0, 1), (1, 2), (3, 1)]:
        if wire == "int8":
            sl = slice(start, start + n)
            write_heads(parts, 0, qk[:, sl], qv[:, sl], slots, start, (sk[:, sl], sv[:, sl]))
        else:
            write_heads(parts, 0, k[:, start:start + n], v[:, start:start + n], slots, start)
    for a, b in zip(whole.read(0, torch.arange(4), 32), parts.read(0, torch.arange(4), 32), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="outside this cache's 4"):
        write_heads(parts, 0, k[:, :2], v[:, :2], slots, 3)


async def receiver(spec: LoadSpec) -> tuple[TCPConnector, Sink, TransferTarget]:
    recv, got = TCPConnector(SECRET, TransferOptions(timeout_s=5.0)), Sink()
    recv.importer = got
    port = await recv.listen()
    recv.start_load_kv(spec)
    return recv, got, TransferTarget("127.0.0.1", port)


async def test_receiver_takes_only_its_planned_ranges() -> None:
    # decode rank 1 of TP 2 with 4 KV heads: heads 2..3, in one piece from head 2
    recv, got, t = await receiver(LoadSpec("r", 1, T, 2, D, head_offset=2, pieces=((2, 2),)))
    send = TCPConnector(SECRET, TransferOptions(timeout_s=5.0, max_retries=0))
    send.start_save_heads("r", [HeadRoute(t.host, t.port, 1, 2, 1)], 1)  # heads 1..2: not the plan
    send.save_kv_layer("r", 0, *kv())
    with pytest.raises(TransferError, match="SHAPE_MISMATCH"):
        await send.wait_for_save("r")
    with pytest.raises(TransferError, match="from head 1"):
        await recv.wait_for_load("r", timeout=5)
    assert not got
    await asyncio.gather(send.close(), recv.close())


async def test_a_whole_layer_receiver_refuses_a_head_range() -> None:
    recv, got, t = await receiver(LoadSpec("w", 1, T, H, D))  # today's spec: all heads, from head 0
    send = TCPConnector(SECRET, TransferOptions(timeout_s=5.0, max_retries=0))
    send.start_save_heads("w", [HeadRoute(t.host, t.port, 0, 2, 2)], 1)
    send.save_kv_layer("w", 0, *kv())
    with pytest.raises(TransferError, match="SHAPE_MISMATCH"):
        await send.wait_for_save("w")
    await asyncio.gather(send.close(), recv.close())


async def test_ranges_land_at_their_offsets_and_complete_the_layer() -> None:
    """TP 1 -> TP 2 seen from decode rank 1 plus a replicated duplicate range: resends are ignored, the
    layer completes once every (token, head) is in."""
    recv, got, t = await receiver(LoadSpec("p", 2, T, 2, D, head_offset=2, pieces=((2, 2),)))
    send = TCPConnector(SECRET, TransferOptions(timeout_s=5.0), chunk_bytes=5 * 2 * 2 * D * 4)  # 5 tokens a frame
    send.start_save_heads("p", [HeadRoute(t.host, t.port, 2, 2, 2)], 2)
    for layer in range(2):
        send.save_kv_layer("p", layer, *kv(layer))
    res = await send.wait_for_save("p")
    await recv.wait_for_load("p", timeout=5)
    assert res.bytes == 2 * T * 2 * 2 * D * 4
    assert got.head_offsets == [0] * 6  # global heads 2..3 are this cache's heads 0..1; 3 frames a layer
    for layer in range(2):
        k, v = kv(layer)
        assert torch.equal(got[("p", layer)][0], k[:, 2:]) and torch.equal(got[("p", layer)][1], v[:, 2:])
    await asyncio.gather(send.close(), recv.close())


async def test_same_frames_as_today_for_a_route_of_all_heads() -> None:
    """A head route covering all of the sender's heads from head 0 is today's transfer: same frames."""
    recv, got, t = await receiver(LoadSpec("x", 1, T, H, D))
    recv.start_load_kv(LoadSpec("y", 1, T, H, D))
    frames: dict[str, list[Frame]] = {"x": [], "y": []}
    for rid in frames:
        send = TCPConnector(SECRET, TransferOptions())
        orig = send._frames

        def record(*a: object, _orig: object = orig, **kw: object) -> list[Frame]:
            out = _orig(*a, **kw)  # type: ignore[operator]
            frames[str(a[0])].extend(out)
            return out

        send._frames = record  # type: ignore[method-assign]
        if rid == "x":
            send.start_save_heads(rid, [HeadRoute(t.host, t.port, 0, H, 0)], 1)
        else:
            send.start_save(rid, t, 1)
        send.save_kv_layer(rid, 0, *kv())
        await send.wait_for_save(rid)
        await send.close()
    await recv.wait_for_load("x", timeout=5)
    await recv.wait_for_load("y", timeout=5)
    (a,), (b,) = frames["x"], frames["y"]
    assert (a.head_start, a.kv_heads, bytes(a.payload)) == (0, H, bytes(b.payload)) and b.head_start == 0
    assert got.head_offsets == [0, 0] and torch.equal(got[("x", 0)][0], got[("y", 0)][0])
    await recv.close()


async def test_one_route_failing_ends_the_transfer_and_aborts_the_others() -> None:
    recv, _, t = await receiver(LoadSpec("f", 1, T, 2, D, head_offset=0, pieces=((0, 2),)))
    dead = TCPConnector(SECRET, TransferOptions())
    dead_port = await dead.listen()
    await dead.close()  # a decode rank that is gone
    send = TCPConnector(SECRET, TransferOptions(timeout_s=5.0, max_retries=1))
    send.start_save_heads("f", [HeadRoute(t.host, t.port, 0, 2, 0), HeadRoute("127.0.0.1", dead_port, 2, 2, 2)], 1)
    send.save_kv_layer("f", 0, *kv())
    with pytest.raises(TransferError, match=f"127.0.0.1:{dead_port}"):
        await send.wait_for_save("f")
    assert not send._outboxes
    with pytest.raises(TransferError):  # aborted by the sender, or its range in and the load then cancelled
        await recv.wait_for_load("f", timeout=5)
        recv.cancel_load("f")
        await recv.wait_for_load("f", timeout=5)
    await asyncio.gather(send.close(), recv.close())
