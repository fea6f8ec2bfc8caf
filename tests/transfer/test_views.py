"""Sending a float layer from the cache's own blocks (views.py, `save_kv_views`, the engine's `_send_views`):
the same wire as a gathered export, only the last prefill chunk, and never a send from blocks taken back."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from pdcluster.worker.engine.kv_cache import PagedKVCache
from pdcluster.worker.engine.kv_transfer import slot_views
from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine
from pdcluster.worker.engine.sampling_params import SamplingParams
from pdcluster.worker.transfer import views
from pdcluster.worker.transfer.channel import TransferError
from pdcluster.worker.transfer.codec import encode_layer
from pdcluster.worker.transfer.connector import LoadSpec, TCPConnector, TransferTarget
from pdcluster.worker.transfer.frame import FrameKey, encode_frame
from pdcluster.worker.transfer.options import TransferOptions

SECRET = b"v" * 32
P = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("chunk", [1 << 20, 3 * 2 * 2 * 8 * 4, 100])
def test_view_frames_are_the_frames_of_a_gathered_export(chunk: int) -> None:
    """Fragmented slots, cut into several frames or not: byte for byte (tags included) the frames the
    gathered export gives, so the receiver cannot tell the two apart."""
    cache = PagedKVCache(2, 8, 4, 2, 8)
    for pool in (*cache.k, *cache.v):
        pool.copy_(torch.randn(pool.shape))
    slots = torch.tensor([22, 23, 8, 9, 10, 11, 12, 2, 3])
    got = views.view_frames("r", 1, 2, slot_views(cache, 1, slots), token_start=5, num_tokens=len(slots),
                            kv_heads=2, head_dim=8, dtype=torch.float32, chunk_bytes=chunk)
    out = torch.empty(cache.export_bytes(1, len(slots)), dtype=torch.uint8)
    k, v, _ = cache.export_into(1, slots, out)
    step = got[0].num_tokens
    assert len(got) == -(-len(slots) // step) and (len(got) > 1) == (chunk < 2 * 9 * 2 * 8 * 4)
    key = FrameKey(b"k" * 32)
    for i, f in enumerate(got):
        s = i * step
        want = encode_layer("r", 1, 2, k[s:s + step], v[s:s + step], token_start=5 + s)
        assert encode_frame(f, key, i) == encode_frame(want, key, i)


def test_views_of_the_wrong_size_or_dtype_are_refused() -> None:
    mv = memoryview(bytearray(2 * 3 * 2 * 8 * 4))
    with pytest.raises(ValueError):
        views.view_frames("r", 0, 1, [mv], token_start=0, num_tokens=4, kv_heads=2, head_dim=8,
                          dtype=torch.float32, chunk_bytes=1 << 20)
    with pytest.raises(ValueError):
        views.view_frames("r", 0, 1, [mv], token_start=0, num_tokens=3, kv_heads=2, head_dim=8,
                          dtype=torch.int8, chunk_bytes=1 << 20)


class Recorder(TCPConnector):
    """What the engine hands over, without a transport: gathered ranges and ranges of views."""

    def __init__(self) -> None:
        super().__init__(SECRET, TransferOptions())
        self.calls: list[tuple[str, int, int, Any]] = []

    def save_kv_layer(self, request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor,
                      token_start: int = 0, scales: Any = None) -> None:
        self.calls.append(("gathered", layer, token_start, torch.cat([k, v]).clone()))

    def save_kv_views(self, request_id: str, layer: int, parts: list[memoryview], **kw: Any) -> bool:
        data = torch.frombuffer(bytearray(b"".join(bytes(p) for p in parts)), dtype=kw["dtype"]).clone()
        self.calls.append(("views", layer, kw["token_start"], (data, kw["held"])))
        return True


def test_engine_sends_only_the_last_chunk_from_its_blocks(tiny_model_dir: Path) -> None:
    """Earlier chunks are gathered (a later step may still preempt the request and reuse their blocks); the
    last is sent from the blocks, whose bytes are exactly what the gather would have copied."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, block_size=8,
                                    max_batch_tokens=16))
    rec = Recorder()
    engine.set_kv_connector(rec)
    prompt = [(i * 31) % 400 + 3 for i in range(40)]
    engine.add_request("a", prompt, P, prefill_only=True)
    while engine.has_unfinished():
        engine.step()
    layers = engine.model_config.num_layers
    kinds = [(kind, start) for kind, _, start, _ in rec.calls]
    assert kinds == [("gathered", 0)] * layers + [("gathered", 16)] * layers + [("views", 32)] * layers
    seq = engine.seqs["a"]
    for kind, layer, _start, got in rec.calls:
        if kind == "views":
            data, held = got
            slots = engine.runner.slots(seq, 32, 40)
            out = torch.empty(engine.runner.cache.export_bytes(layer, 8), dtype=torch.uint8)
            k, v, _ = engine.runner.cache.export_into(layer, slots, out)
            assert torch.equal(data, torch.cat([k, v]).flatten()) and held()
    holds = [got[1] for kind, _, _, got in rec.calls if kind == "views"]
    engine.release("a")
    assert not any(h() for h in holds)  # released: a frame not yet sent must not be sent from them
    engine.block_manager.check_no_leaks()


def test_a_request_finished_on_its_first_token_tells_the_sender(tiny_model_dir: Path) -> None:
    """max_tokens=1: the request finishes in the step that prefilled it and its blocks are freed at once."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64))
    rec = Recorder()
    engine.set_kv_connector(rec)
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=1, temperature=0.0), prefill_only=True)
    while engine.has_unfinished():
        engine.step()
    holds = [got[1] for kind, _, _, got in rec.calls if kind == "views"]
    assert holds and not any(h() for h in holds)
    engine.block_manager.check_no_leaks()


async def test_views_whose_blocks_were_taken_back_are_never_sent() -> None:
    """Regression: without the check a frame viewing freed blocks went out (another request's KV, or a tag
    over bytes that changed under it). Now the save fails and the receiver gets nothing."""
    got: list[int] = []
    recv = TCPConnector(SECRET, TransferOptions(), importer=lambda rid, layer, k, v, **kw: got.append(layer))
    port = await recv.listen()
    send = TCPConnector(SECRET, TransferOptions())
    recv.start_load_kv(LoadSpec("r", 2, 4, 2, 8))
    send.start_save("r", TransferTarget("127.0.0.1", port), 2)
    kv = torch.randn(2, 4, 2, 8)
    parts = [memoryview(kv[i].numpy()).cast("B") for i in range(2)]
    assert send.save_kv_views("r", 0, parts, token_start=0, num_tokens=4, kv_heads=2, head_dim=8,
                              dtype=torch.float32, held=lambda: False)
    with pytest.raises(TransferError, match="released"):
        await send.wait_for_save("r")
    await asyncio.sleep(0.05)
    assert got == []
    await send.close()
    await recv.close()


def test_int8_frame_from_views_is_the_frame_of_a_gathered_export() -> None:
    """int8 compression quantized where the runs lie: the codes and scales of the gathered layer, bit for bit."""
    cache = PagedKVCache(2, 8, 4, 2, 8)
    for pool in (*cache.k, *cache.v):
        pool.copy_(torch.randn(pool.shape))
    slots = torch.tensor([22, 23, 8, 9, 10, 11, 12, 2, 3])
    out = torch.empty(cache.export_bytes(1, len(slots)), dtype=torch.uint8)
    k, v, _ = cache.export_into(1, slots, out)
    key = FrameKey(b"k" * 32)
    for frame_bytes, step in ((1 << 20, 9), (2 * 2 * (8 + 4) * 4, 4)):  # one frame; frames of 4 tokens
        got = views.quantized_frames("r", 1, 2, slot_views(cache, 1, slots), token_start=3, num_tokens=len(slots),
                                     kv_heads=2, head_dim=8, frame_bytes=frame_bytes)
        assert len(got) == -(-len(slots) // step)
        for i, f in enumerate(got):
            s = i * step
            want = encode_layer("r", 1, 2, k[s:s + step], v[s:s + step], token_start=3 + s, compression="int8")
            assert encode_frame(f, key, i) == encode_frame(want, key, i)


async def test_int8_compression_of_a_big_layer_without_the_native_kernel_keeps_the_gather(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Over INLINE_MAX the torch quantizer would hold the engine's thread: the gather and the encoder thread's
    pipeline (chunking.py) take it. With the native kernel the views are quantized in frames of PIPE_BYTES."""
    from pdcluster.kernels import native as kernels

    tokens = 4096  # 2 x 4096 x 2 x 128 x 4 B = 8 MiB of fp32
    mv = memoryview(bytearray(2 * tokens * 2 * 128 * 4))
    for native in (False, True):
        if not native:
            monkeypatch.setenv(kernels.SWITCH, "-quant")
        elif not kernels.quant_ready():
            continue
        send = TCPConnector(SECRET, TransferOptions(compression="int8"))
        send.start_save("r", TransferTarget("127.0.0.1", 9), 1)
        sent = send.save_kv_views("r", 0, [mv], token_start=0, num_tokens=tokens, kv_heads=2, head_dim=128,
                                  dtype=torch.float32)
        assert sent == native
        await send.abort_save("r")
        await send.close()
        monkeypatch.undo()


async def test_int8_layers_from_views_arrive_as_the_receiver_expects() -> None:
    """Through a real connector pair: small fp32 layers sent as int8 from views, dequantized on arrival."""
    got: dict[int, torch.Tensor] = {}

    def importer(rid: str, layer: int, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> None:
        sk, sv = kw["scales"]
        got[layer] = torch.cat([k.float() * sk.unsqueeze(-1), v.float() * sv.unsqueeze(-1)])

    recv = TCPConnector(SECRET, TransferOptions(), importer=importer)
    port = await recv.listen()
    send = TCPConnector(SECRET, TransferOptions(compression="int8"))
    kv = torch.randn(3, 2, 5, 2, 8)
    recv.start_load_kv(LoadSpec("r", 3, 5, 2, 8))
    send.start_save("r", TransferTarget("127.0.0.1", port), 3)
    for layer in range(3):
        parts = [memoryview(kv[layer, i].numpy()).cast("B") for i in range(2)]
        assert await asyncio.to_thread(send.save_kv_views, "r", layer, parts, token_start=0, num_tokens=5,
                                       kv_heads=2, head_dim=8, dtype=torch.float32)
    await send.wait_for_save("r")
    await recv.wait_for_load("r", timeout=10)
    for layer in range(3):
        assert torch.allclose(got[layer], kv[layer].reshape(10, 2, 8), atol=0.05)
    await send.close()
    await recv.close()
