"""Greedy output of the sharded engine at TP 1, 2 and 4 is token-identical to transformers' generate, and its
logits close (fp32), on tiny random models whose head counts make TP split the KV heads (kv == tp, kv > tp)
and replicate them (kv < tp). Real follower processes, gloo on loopback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdcluster.worker.engine.llm_engine import LLMEngine
from pdcluster.worker.engine.sampling_params import SamplingParams

from .conftest import hf_greedy

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
# Different lengths in one batch; the last two share a 16-token prefix (two blocks of 8), so the second
# of them is prefilled from the prefix cache (a chunk that starts past 0 on every rank).
SHARED = [7, 3, 99, 120, 5, 8, 200, 31, 17, 64, 2, 9, 77, 140, 33, 12]
PROMPTS = {"a": [1, 5, 9, 33, 7], "b": [2, 8, 100, 249 % 240, 3, 4, 5, 6, 7, 11, 13], "c": SHARED + [4, 6],
           "d": SHARED + [90, 91, 92]}


def run(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], torch.Tensor]]:
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
    toks: dict[str, list[int]] = {rid: [] for rid in prompts}
    logits: dict[str, list[torch.Tensor]] = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            toks[out.request_id] += out.new_token_ids
            logits[out.request_id].append(out.extra["logits"])
    return {rid: (toks[rid], torch.stack(logits[rid])) for rid in prompts}


@pytest.mark.parametrize(
    "kind,tp,chunk",
    [("llama", 1, 2048), ("llama", 2, 2048), ("llama", 4, 6), ("qwen2", 2, 6), ("mixtral", 2, 2048)],
    ids=["llama-tp1", "llama-tp2-kv_eq_tp", "llama-tp4-kv_lt_tp-chunked", "qwen2-tp2-kv_gt_tp-tied-chunked",
         "mixtral-tp2-replicated-experts"],
)
def test_greedy_matches_hf(tp_models: dict[str, Path], make_tp_engine: Any, kind: str, tp: int, chunk: int) -> None:
    model = tp_models[kind]
    # the first two run in one batch; then the shared-prefix pair, so "d" hits the prefix cache "c" filled
    engine = make_tp_engine(model, tp, debug_logits=True, max_batch_tokens=chunk)
    got = run(engine, {k: PROMPTS[k] for k in ("a", "b", "c")})
    got.update(run(engine, {"d": PROMPTS["d"]}))
    assert engine.block_manager.prefix_hits > 0  # "d" started from cached blocks
    for rid, prompt in PROMPTS.items():
        want_ids, want_logits = hf_greedy(model, prompt, MAX_NEW)
        ids, logits = got[rid]
        assert ids == want_ids, f"{kind} TP {tp} request {rid}"
        torch.testing.assert_close(logits, want_logits, atol=2e-4, rtol=1e-4)
    engine.block_manager.check_no_leaks()


def test_swap_preemption_under_tp_matches_tp1(tp_models: dict[str, Path], make_tp_engine: Any) -> None:
    """Too few blocks for the batch: sequences are swapped out and back in on every rank (the swap copies
    travel with the step), and the tokens are still TP 1's with a cache large enough for everything."""
    prompts = [[(13 * n + 7 * j) % 240 + 1 for j in range(n)] for n in (20, 9, 33, 14, 25, 17)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    want = make_tp_engine(tp_models["llama"], 1, num_kv_blocks=256).generate(prompts, params)
    engine = make_tp_engine(tp_models["llama"], 2, num_kv_blocks=20, preemption_mode="swap")
    assert engine.generate(prompts, params) == want
    assert engine.stats()["preemptions_total"] > 0
    assert engine.runner.local._host_cache is not None  # really went through host memory
    engine.block_manager.check_no_leaks()


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_quantized_cache_under_tp_matches_tp1(tp_models: dict[str, Path], make_tp_engine: Any, kv_dtype: str) -> None:
    """KV scales are per token and head, so a rank quantizing only its own heads stores the codes TP 1 would:
    TP 2 over an int8 / int4 cache gives TP 1's tokens over the same cache format."""
    prompts = [PROMPTS["a"], PROMPTS["b"], PROMPTS["c"]]
    want = make_tp_engine(tp_models["llama"], 1, kv_cache_dtype=kv_dtype).generate(prompts, GREEDY)
    assert make_tp_engine(tp_models["llama"], 2, kv_cache_dtype=kv_dtype).generate(prompts, GREEDY) == want
