"""The engine's side of receiving in place (`LLMEngine.import_views`, kv_transfer.slot_views): views of exactly
the reserved slots, and greedy output across the split unchanged when KV lands straight in the blocks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from pdcluster.worker.engine.kv_cache import PagedKVCache
from pdcluster.worker.engine.kv_transfer import slot_views
from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine
from pdcluster.worker.engine.sampling_params import SamplingParams
from pdcluster.worker.transfer.connector import LoadSpec, TCPConnector, TransferTarget
from pdcluster.worker.transfer.options import TransferOptions

SECRET = b"e" * 32
P = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_views_are_the_slots_in_order(dtype: torch.dtype) -> None:
    cache = PagedKVCache(2, 8, 4, 2, 8, dtype=dtype)
    for pool in (*cache.k, *cache.v):
        pool.copy_(torch.randn(pool.shape))
    slots = torch.tensor([22, 23, 8, 9, 10, 11, 12, 2, 3])  # blocks 5 (tail), 2 and 3 (adjacent), 0 (head)
    views = slot_views(cache, 1, slots)
    assert len(views) == 6  # three runs, for K and for V
    want = torch.empty(cache.export_bytes(1, len(slots)), dtype=torch.uint8)
    cache.export_into(1, slots, want)
    assert b"".join(bytes(v) for v in views) == bytes(want.numpy())
    views[1][:] = bytes(len(views[1]))  # they are the cache's memory, not a copy
    assert not cache.k[1].view(-1, 2, 8)[8:13].any()


def _engine(model: Path, **kw: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), num_kv_blocks=128, **kw))  # type: ignore[arg-type]


async def test_greedy_output_is_unchanged_when_kv_lands_in_the_blocks(tiny_model_dir: Path) -> None:
    prompts = {f"r{n}": [(i * 37 + n) % 500 + 3 for i in range(n)] for n in (1, 9, 40, 77)}
    mono = _engine(tiny_model_dir)
    expected = dict(zip(prompts, mono.generate(list(prompts.values()), P), strict=True))

    prefill, decode = _engine(tiny_model_dir, block_size=16), _engine(tiny_model_dir, block_size=8)
    layers = decode.model_config.num_layers
    recv = TCPConnector(SECRET, TransferOptions(), importer=decode.import_kv_layer, destination=decode.import_views)
    port = await recv.listen()
    send = TCPConnector(SECRET, TransferOptions(), chunk_bytes=4096)  # long prompts go in several token ranges per layer
    prefill.set_kv_connector(send)
    asked = []
    real_views = decode.import_views

    def views(*a: object) -> object:
        got = real_views(*a)  # type: ignore[arg-type]
        asked.append(got is not None)
        return got

    recv.destination = views
    spacer = [3] * 20
    assert decode.reserve_for_import("spacer", spacer, P)  # the imports' blocks do not start at block 0
    first: dict[str, int] = {}
    for rid, p in prompts.items():
        assert decode.reserve_for_import(rid, p, P)
        recv.start_load_kv(LoadSpec(rid, layers, len(p), decode.model_config.num_kv_heads,
                                    decode.model_config.head_dim))
        send.start_save(rid, TransferTarget("127.0.0.1", port), layers)
        prefill.add_request(rid, p, P, prefill_only=True)
        while prefill.has_unfinished():
            for out in await asyncio.to_thread(prefill.step):
                first[out.request_id] = out.new_token_ids[0]
        await send.wait_for_save(rid)
        await recv.wait_for_load(rid, timeout=30)
        recv.finish_load(rid)
        prefill.release(rid)
        decode.commit_import(rid, first[rid])
    decode.cancel_import("spacer")
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    while decode.has_unfinished():
        for out in decode.step():
            got[out.request_id] += out.new_token_ids
    assert got == {rid: expected[rid] for rid in prompts}
    assert asked and all(asked)  # every range was placed, none imported through a copy
    await send.close()
    await recv.close()
