"""Disaggregation hooks: prefill-only requests, layer-by-layer KV export, import into another engine."""

from __future__ import annotations

import pytest
import torch
from pdcluster.worker.engine.sampling_params import SamplingParams

from .conftest import prompt_of

P = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = {"a": prompt_of(37, seed=1), "b": prompt_of(16, seed=2), "c": prompt_of(1, seed=3)}


def _prefill_and_stream(engine) -> tuple[dict[str, list[tuple[torch.Tensor, torch.Tensor]]], dict[str, int]]:
    """Prefill-only on ``engine``; KV leaves layer by layer from inside the forward, via layer_hook."""
    layers = engine.model_config.num_layers
    streamed: dict[str, list] = {rid: [None] * layers for rid in PROMPTS}

    def hook(layer: int, request_ids: list[str]) -> None:
        for rid in request_ids:
            streamed[rid][layer] = tuple(t.clone() for t in engine.export_kv(rid, layer))

    engine.layer_hook = hook
    for rid, p in PROMPTS.items():
        engine.add_request(rid, p, P, prefill_only=True)
    first: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.finished and out.extra.get("kv_held") and len(out.new_token_ids) == 1
            first[out.request_id] = out.new_token_ids[0]
    assert set(first) == set(PROMPTS)
    return streamed, first


@pytest.mark.parametrize(
    "decode_kw",
    [
        dict(block_size=32),
        dict(block_size=32, kv_cache_dtype="int8"),
        dict(block_size=8, kv_cache_dtype="int4"),
    ],
)
def test_export_import_matches_monolithic(make_engine, decode_kw):
    mono = make_engine(**decode_kw)
    expected = dict(zip(PROMPTS, mono.generate(list(PROMPTS.values()), P), strict=True))

    prefill = make_engine(block_size=16)
    streamed, first = _prefill_and_stream(prefill)
    for rid, p in PROMPTS.items():
        # what left mid-forward equals what is in the cache afterwards, and has the right shape
        for layer, (k, v) in enumerate(streamed[rid]):
            k2, v2 = prefill.export_kv(rid, layer)
            assert k.shape == (len(p), 2, 16)
            assert torch.equal(k, k2) and torch.equal(v, v2)
        prefill.release(rid)
    assert prefill.block_manager.num_used_blocks == 0

    decode = make_engine(**decode_kw)
    for rid, p in PROMPTS.items():
        assert decode.reserve_for_import(rid, p, P)
        for layer, (k, v) in reversed(list(enumerate(streamed[rid]))):  # any order
            decode.import_kv_layer(rid, layer, k, v)
        decode.commit_import(rid, first[rid])
    got = {rid: [] for rid in PROMPTS}
    while decode.has_unfinished():
        for out in decode.step():
            got[out.request_id] += out.new_token_ids
    assert got == expected


def test_reserve_fails_cleanly_and_cancel_frees(make_engine):
    engine = make_engine(block_size=16, num_kv_blocks=4)
    assert engine.reserve_for_import("x", prompt_of(40), SamplingParams(max_tokens=8))  # 3 blocks
    assert not engine.reserve_for_import("y", prompt_of(40), SamplingParams(max_tokens=8))  # never OOM
    assert "y" not in engine.seqs
    engine.cancel_import("x")
    assert engine.block_manager.num_used_blocks == 0


def test_prefill_only_holds_blocks_until_release_or_abort(make_engine):
    engine = make_engine()
    engine.add_request("a", prompt_of(20), P, prefill_only=True)
    engine.add_request("b", prompt_of(20, seed=9), P, prefill_only=True)
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_used_blocks == 4
    engine.release("a")
    assert engine.abort("b")
    engine.release("unknown")  # no-op


def test_import_wrong_token_count_is_rejected(make_engine):
    engine = make_engine()
    assert engine.reserve_for_import("x", prompt_of(5), P)
    with pytest.raises(ValueError, match="5 tokens"):
        engine.import_kv_layer("x", 0, torch.zeros(4, 2, 16), torch.zeros(4, 2, 16))
    engine.cancel_import("x")
