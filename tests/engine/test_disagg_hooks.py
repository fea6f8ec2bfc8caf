"""Disaggregation hooks: prefill-only requests, layer-by-layer KV export, import into another engine."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdcluster.worker.engine.kv_connector import KVConnectorBase
from pdcluster.worker.engine.sampling_params import SamplingParams
from tests.kv_read import export_kv

from .conftest import prompt_of

P = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = {"a": prompt_of(37, seed=1), "b": prompt_of(16, seed=2), "c": prompt_of(1, seed=3)}


class Recorder(KVConnectorBase):
    """An engine KV connector that keeps what the engine hands it: per request and layer, the token ranges."""

    def __init__(self) -> None:
        self.ranges: dict[str, dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]]] = {}

    def save_kv_layer(self, request_id, layer, k, v, token_start=0, scales=None) -> None:
        assert scales is None, "these tests export float layers"
        self.ranges.setdefault(request_id, {}).setdefault(layer, []).append((token_start, k.clone(), v.clone()))

    def assembled(self, rid: str, layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's ranges, checked to tile [0, n) in order with no gap or overlap, concatenated."""
        out = []
        for layer in range(layers):
            parts = self.ranges[rid][layer]
            assert [s for s, _, _ in parts] == list(itertools.accumulate([0] + [k.shape[0] for _, k, _ in parts[:-1]]))
            out.append((torch.cat([k for _, k, _ in parts]), torch.cat([v for _, _, v in parts])))
        return out


def _prefill_and_stream(engine) -> tuple[dict[str, list[tuple[torch.Tensor, torch.Tensor]]], dict[str, int]]:
    """Prefill-only on ``engine``; the engine hands KV layer by layer from inside the forward to its connector."""
    layers = engine.model_config.num_layers
    rec = Recorder()
    engine.set_kv_connector(rec)
    for rid, p in PROMPTS.items():
        engine.add_request(rid, p, P, prefill_only=True)
    first: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.finished and out.extra.get("kv_held") and len(out.new_token_ids) == 1
            first[out.request_id] = out.new_token_ids[0]
    assert set(first) == set(PROMPTS)
    return {rid: rec.assembled(rid, layers) for rid in PROMPTS}, first


def test_chunked_prefill_and_prefix_hits_export_each_token_once(make_engine):
    """A token budget of 16 splits a 40-token prompt in chunks: each chunk's range leaves once per layer. A
    second request sharing a 32-token prefix gets it from the prefix cache, and its first chunk still
    ships from token 0 (the decode side has none of it). Requests that are not prefill-only export nothing."""
    engine = make_engine(block_size=16, max_batch_tokens=16)
    rec = Recorder()
    engine.set_kv_connector(rec)
    base = prompt_of(32, seed=4)
    prompts = {"a": base + prompt_of(8, seed=5), "b": base + prompt_of(5, seed=6)}
    layers = engine.model_config.num_layers
    for rid, p in prompts.items():
        engine.add_request(rid, p, P, prefill_only=True)
        while engine.has_unfinished():
            engine.step()
    engine.add_request("plain", prompt_of(20, seed=7), SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    assert set(rec.ranges) == {"a", "b"}
    assert [s for s, _, _ in rec.ranges["a"][0]] == [0, 16, 32]
    assert engine.stats()["prefix_cache_hit_blocks"] >= 2
    for rid, p in prompts.items():
        got = rec.assembled(rid, layers)
        for layer in range(layers):
            k, v = export_kv(engine, rid, layer)
            assert got[layer][0].shape[0] == len(p)
            assert torch.equal(got[layer][0], k) and torch.equal(got[layer][1], v)
        engine.release(rid)


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
            k2, v2 = export_kv(prefill, rid, layer)
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


def test_import_outside_the_prompt_is_rejected(make_engine):
    """Token ranges import one at a time (chunked transfers), but never past the reserved prompt."""
    engine = make_engine()
    assert engine.reserve_for_import("x", prompt_of(5), P)
    engine.import_kv_layer("x", 0, torch.zeros(4, 2, 16), torch.zeros(4, 2, 16))  # tokens 0..3 of 5: fine
    with pytest.raises(ValueError, match="5 tokens"):
        engine.import_kv_layer("x", 0, torch.zeros(6, 2, 16), torch.zeros(6, 2, 16))
    with pytest.raises(ValueError, match="5 tokens"):
        engine.import_kv_layer("x", 0, torch.zeros(2, 2, 16), torch.zeros(2, 2, 16), token_start=4)
    with pytest.raises(ValueError, match="scales"):
        engine.import_kv_layer("x", 0, torch.zeros(2, 2, 16, dtype=torch.int8), torch.zeros(2, 2, 16, dtype=torch.int8))
    engine.cancel_import("x")
