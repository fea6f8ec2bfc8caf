"""Our engine against transformers' LlamaForCausalLM: same greedy tokens, close fp32 logits at every step."""

from __future__ import annotations

import pytest
import torch

from pdcluster.worker.engine.sampling_params import SamplingParams
from pdcluster.worker.local.demo_model import build_demo_model

from .conftest import GREEDY, hf_greedy, prompt_of, run_with_logits

# 1 token, around each block boundary (block size 16), and long (several blocks; > max_batch_tokens below)
LENGTHS = [1, 2, 15, 16, 17, 31, 32, 33, 100]
ATOL = 1e-4


def _check(model_dir, prompt, toks, logits, n=GREEDY.max_tokens):
    ref_toks, ref_logits = hf_greedy(model_dir, prompt, n)
    assert toks == ref_toks, f"prompt length {len(prompt)}"
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("n", LENGTHS)
def test_alone_matches_hf(make_engine, tiny_model_dir, n):
    engine = make_engine(debug_logits=True)
    prompt = prompt_of(n, seed=n)
    toks, logits = run_with_logits(engine, {"r": prompt})["r"]
    _check(tiny_model_dir, prompt, toks, logits)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_continuous_batch_matches_hf(make_engine, tiny_model_dir, block_size):
    """All lengths share one engine; some are added while others are mid-decode (continuous batching)."""
    engine = make_engine(debug_logits=True, block_size=block_size, max_batch_tokens=64)
    prompts = {f"r{n}": prompt_of(n, seed=n) for n in LENGTHS}
    late = dict(list(prompts.items())[5:])
    early = {k: v for k, v in prompts.items() if k not in late}
    for rid, p in early.items():
        engine.add_request(rid, p, GREEDY)
    toks = {rid: [] for rid in prompts}
    logits = {rid: [] for rid in prompts}
    steps = 0
    while engine.has_unfinished() or late:
        if steps == 3:  # join while the early ones decode
            for rid, p in late.items():
                engine.add_request(rid, p, GREEDY)
            late = {}
        for out in engine.step():
            toks[out.request_id] += out.new_token_ids
            logits[out.request_id].append(out.extra["logits"])
        steps += 1
    for rid, p in prompts.items():
        _check(tiny_model_dir, p, toks[rid], torch.stack(logits[rid]))


def test_chunked_prefill_matches_hf(make_engine, tiny_model_dir):
    engine = make_engine(debug_logits=True, max_batch_tokens=24)  # 100-token prompt in 5 chunks
    prompt = prompt_of(100, seed=7)
    toks, logits = run_with_logits(engine, {"r": prompt})["r"]
    _check(tiny_model_dir, prompt, toks, logits)


def test_prefix_cache_hit_matches_hf(make_engine, tiny_model_dir):
    engine = make_engine(debug_logits=True)
    shared = prompt_of(40, seed=3)
    first = shared + prompt_of(5, seed=4)
    second = shared + prompt_of(9, seed=5)
    run_with_logits(engine, {"a": first})
    toks, logits = run_with_logits(engine, {"b": second})["b"]
    assert engine.stats()["prefix_cache_hit_blocks"] == 2  # 40 shared tokens = 2 full blocks of 16
    _check(tiny_model_dir, second, toks, logits)


def test_max_tokens_and_eos(make_engine, tiny_model_dir):
    engine = make_engine()
    prompt = prompt_of(10)
    ref, _ = hf_greedy(tiny_model_dir, prompt, 8)
    eos = ref[4]
    out = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[eos]))[0]
    assert out == ref[: ref.index(eos) + 1]  # the stop token is reported, generation ends there
    assert engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0))[0] == ref[:3]


VARIANTS = {
    "llama3-rope-scaling": dict(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    ),
    "legacy-rope_theta-rope_scaling": dict(
        rope_parameters=None,
        rope_theta=20000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "linear-rope": dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "qkv-bias-qwen2": dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        attention_bias=True,
        use_sliding_window=False,
        sliding_window=None,
    ),
    "tied-embeddings-mha": dict(tie_word_embeddings=True, num_key_value_heads=4),
    "head_dim-32-mqa": dict(head_dim=32, num_key_value_heads=1),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variants_match_hf(make_engine, tmp_path, variant):
    base = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        tokenizer=False,
        max_position_embeddings=512,
    )
    folder = build_demo_model(tmp_path / variant, **{**base, **VARIANTS[variant]})
    engine = make_engine(model=folder, debug_logits=True, block_size=8)
    prompts = {"a": prompt_of(70, seed=1, vocab=300), "b": prompt_of(9, seed=2, vocab=300)}
    res = run_with_logits(engine, prompts)
    for rid, p in prompts.items():
        _check(folder, p, *res[rid])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_run(make_engine, tiny_model_dir, dtype):
    """Half precision: tokens mostly agree with fp32 (not bit-exact; just a sanity check that it runs)."""
    engine = make_engine(dtype=dtype)
    prompt = prompt_of(20)
    out = engine.generate([prompt], GREEDY)[0]
    assert len(out) == GREEDY.max_tokens
    assert engine.runner.model.embed_tokens.weight.dtype == getattr(torch, dtype)
