"""KV export and import under tensor parallelism (parallel/kv_relay.py), engine to engine with real follower
processes: a TP engine exports every KV head of each layer (gathered to rank 0), and an engine of another
layout imports that into its own shards; decoding from there gives the tokens a TP 1 engine gives."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from pdcluster.worker.engine.kv_connector import KVConnectorBase
from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine
from pdcluster.worker.engine.parallel.kv_relay import first_holders
from pdcluster.worker.engine.sampling_params import SamplingParams

P = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = {"a": [(7 * i + 3) % 240 + 1 for i in range(37)], "b": [(5 * i + 1) % 240 + 1 for i in range(9)]}


class Recorder(KVConnectorBase):
    """Keeps what the engine hands over, per request and layer: (token_start, k, v, scales) copies."""

    def __init__(self) -> None:
        self.ranges: dict[str, dict[int, list[tuple[int, Any, Any, Any]]]] = {}

    def save_kv_layer(self, request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor, token_start: int = 0,
                      scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        s = tuple(x.clone() for x in scales) if scales is not None else None
        self.ranges.setdefault(request_id, {}).setdefault(layer, []).append((token_start, k.clone(), v.clone(), s))


def joined(parts: list[tuple[int, Any, Any, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    assert [p[0] for p in parts] == list(itertools.accumulate([0] + [p[1].shape[0] for p in parts[:-1]]))
    return torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])


def prefill(engine: LLMEngine) -> tuple[Recorder, dict[str, int]]:
    rec = Recorder()
    engine.set_kv_connector(rec)
    for rid, p in PROMPTS.items():
        engine.add_request(rid, p, P, prefill_only=True)
    first: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            first[out.request_id] = out.new_token_ids[0]
    for rid in PROMPTS:
        engine.release(rid)
    return rec, first


def decode_from(engine: LLMEngine, rec: Recorder, first: dict[str, int]) -> dict[str, list[int]]:
    """Import every recorded range into ``engine`` and decode: the tokens each request ends with."""
    for rid, p in PROMPTS.items():
        assert engine.reserve_for_import(rid, p, P)
        for layer, parts in rec.ranges[rid].items():
            for start, k, v, scales in parts:
                engine.import_kv_layer(rid, layer, k, v, token_start=start, scales=scales)
        engine.commit_import(rid, first[rid])
    got: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing leaked
    return got


def test_first_holders_cover_every_head_once() -> None:
    for kv, tp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8)):
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            continue
        heads = [h for _, r in first_holders(kv, tp) for h in r]
        assert heads == list(range(kv)), (kv, tp)
    assert first_holders(2, 4) == [(0, range(0, 1)), (2, range(1, 2))]


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_prefill_tp2_decode_tp1_and_tp1_to_tp2(tp_models: dict[str, Path], make_tp_engine: Any,
                                               kv_dtype: str) -> None:
    """Llama with 2 KV heads: TP 2 export == TP 1 export (every head, in order; chunked prefill: 16-token
    budget), and decoding on the other layout gives TP 1's own greedy tokens."""
    model = tp_models["llama"]
    kw = {"num_kv_blocks": 64, "num_threads": 1, "block_size": 8, "max_batch_tokens": 16,
          "kv_cache_dtype": kv_dtype}
    one = LLMEngine(EngineConfig(model=str(model), **kw))
    want = dict(zip(PROMPTS, one.generate(list(PROMPTS.values()), P), strict=True))
    rec1, first1 = prefill(one)
    two = make_tp_engine(model, 2, **{k: v for k, v in kw.items() if k != "num_threads"})
    rec2, first2 = prefill(two)
    assert first1 == first2 == {rid: t[0] for rid, t in want.items()}
    assert [x[0] for x in rec2.ranges["a"][0]] == [0, 16, 32]  # chunked: one gather per chunk and layer
    for rid in PROMPTS:
        for layer in range(2):
            (k1, v1), (k2, v2) = (joined(r.ranges[rid][layer]) for r in (rec1, rec2))
            assert k2.shape == k1.shape == (len(PROMPTS[rid]), 2, k1.shape[2])  # every head, in order
            tol = 1.01 if kv_dtype == "int8" else 1e-5  # codes: one step of rounding at most
            torch.testing.assert_close(k2.float(), k1.float(), atol=tol, rtol=1e-5)
            torch.testing.assert_close(v2.float(), v1.float(), atol=tol, rtol=1e-5)
    assert decode_from(one, rec2, first2) == want  # prefill TP 2 -> decode TP 1
    assert decode_from(two, rec1, first1) == want  # prefill TP 1 -> decode TP 2


def test_prefill_tp2_decode_tp4_replicated_heads(tp_models: dict[str, Path], make_tp_engine: Any) -> None:
    """2 KV heads at TP 4: each head lives on two decode ranks; both get it (replication)."""
    model = tp_models["llama"]
    one = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=64, num_threads=1, block_size=8))
    want = dict(zip(PROMPTS, one.generate(list(PROMPTS.values()), P), strict=True))
    two = make_tp_engine(model, 2)
    rec, first = prefill(two)
    two.close()  # one tensor-parallel group per process: rank 0 of TP 4 is this process too
    assert decode_from(make_tp_engine(model, 4), rec, first) == want
