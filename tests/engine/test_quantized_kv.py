"""int8 / int4 KV caches: same engine paths, close logits, much smaller blocks."""

from __future__ import annotations

import pytest
import torch

from pdcluster.worker.engine.sampling_params import SamplingParams

from .conftest import prompt_of, run_with_logits

P = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# max |logit difference| vs the float cache over all steps (random tiny model, logits ~0.1-1 in size)
TOL = {"int8": 0.02, "int4": 0.3}


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_quantized_kv_close_to_float(make_engine, kv):
    prompts = {"a": prompt_of(40, seed=1), "b": prompt_of(7, seed=2)}
    ref = run_with_logits(make_engine(debug_logits=True), prompts, P)
    got = run_with_logits(make_engine(debug_logits=True, kv_cache_dtype=kv, max_batch_tokens=16), prompts, P)
    for rid in prompts:
        toks, logits = got[rid]
        ref_toks, ref_logits = ref[rid]
        n = min(len(logits), len(ref_logits))
        # Compare only while the token histories agree (a flipped near-tie changes what follows).
        same = next((i for i in range(n) if toks[i] != ref_toks[i]), n - 1) + 1
        diff = (logits[:same] - ref_logits[:same]).abs().max().item()
        assert diff < TOL[kv], diff


def test_quantized_block_is_smaller(make_engine):
    sizes = {
        kv: make_engine(kv_cache_dtype=kv, num_kv_blocks=4).runner.block_bytes
        for kv in ("auto", "int8", "int4")
    }
    assert sizes["int8"] < sizes["auto"] / 2 and sizes["int4"] < sizes["int8"]


def test_kv_budget_sizes_the_cache(make_engine):
    engine = make_engine(num_kv_blocks=None, kv_cache_memory=1 << 20)
    assert engine.runner.cache.num_blocks == (1 << 20) // engine.runner.block_bytes
    with pytest.raises(ValueError, match="KV cache budget"):
        make_engine(num_kv_blocks=None, kv_cache_memory=10)
    assert engine.runner.cache.k[0].dtype == torch.float32
