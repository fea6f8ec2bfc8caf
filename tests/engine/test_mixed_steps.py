"""Mixed steps: decode tokens and prefill chunks in one forward give the same greedy tokens (and fp32 logits)
as HF and as the alternating prefill/decode schedule."""

from __future__ import annotations

import pytest
import torch

from pdcluster.worker.engine.llm_engine import LLMEngine
from pdcluster.worker.engine.scheduler import Batch

from .conftest import GREEDY, hf_greedy, prompt_of

EARLY = {"a": prompt_of(5, seed=11), "b": prompt_of(17, seed=12)}
LATE = {"c": prompt_of(100, seed=13), "d": prompt_of(33, seed=14), "e": prompt_of(1, seed=15)}


def staggered(engine: LLMEngine) -> tuple[dict[str, list[int]], dict[str, torch.Tensor], list[Batch]]:
    """EARLY first; LATE joins at step 3 while EARLY decodes. Tokens, logits, and every batch scheduled."""
    batches: list[Batch] = []
    schedule = engine.scheduler.schedule

    def spy() -> Batch | None:
        b = schedule()
        if b is not None:
            batches.append(b)
        return b

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    prompts = {**EARLY, **LATE}
    toks: dict[str, list[int]] = {rid: [] for rid in prompts}
    logits: dict[str, list[torch.Tensor]] = {rid: [] for rid in prompts}
    for rid, p in EARLY.items():
        engine.add_request(rid, p, GREEDY)
    steps = 0
    while engine.has_unfinished() or steps <= 3:
        if steps == 3:
            for rid, p in LATE.items():
                engine.add_request(rid, p, GREEDY)
        for out in engine.step():
            toks[out.request_id] += out.new_token_ids
            logits[out.request_id].append(out.extra["logits"])
        steps += 1
    return toks, {rid: torch.stack(v) for rid, v in logits.items()}, batches


def test_mixed_steps_run_and_match_hf(make_engine, tiny_model_dir):
    engine = make_engine(debug_logits=True, max_batch_tokens=24)  # the 100-token prompt rides in 5 chunks
    toks, logits, batches = staggered(engine)
    mixed = [b for b in batches if b.is_prefill and b.num_decode]
    assert len(mixed) >= 5, "late prompts should prefill alongside the decoding ones"
    for b in mixed:
        assert sum(b.num_new_tokens) <= 24 and b.num_new_tokens[: b.num_decode] == [1] * b.num_decode
    for rid, p in {**EARLY, **LATE}.items():
        ref_toks, ref_logits = hf_greedy(tiny_model_dir, p, GREEDY.max_tokens)
        assert toks[rid] == ref_toks, rid
        torch.testing.assert_close(logits[rid], ref_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kw", [dict(kv_cache_dtype="int8"), dict(block_size=8), dict(enable_prefix_caching=False)])
def test_mixed_and_alternating_schedules_agree(make_engine, kw):
    """Quantized caches decode through the paged kernel: the decode rows of a mixed step too. Logits agree to
    the HF tolerance; with int8 codes a last-bit difference of a GEMM over a different row count can move a
    code by one step, so there only the tokens must match exactly."""
    got = {}
    for mixed in (True, False):
        engine = make_engine(debug_logits=True, max_batch_tokens=24, mixed_steps=mixed, **kw)
        toks, logits, batches = staggered(engine)
        assert any(b.num_decode for b in batches) == mixed
        got[mixed] = (toks, logits)
    assert got[True][0] == got[False][0]
    for rid in got[True][1]:
        tol = 1e-3 if kw.get("kv_cache_dtype") == "int8" else 1e-4
        torch.testing.assert_close(got[True][1][rid], got[False][1][rid], atol=tol, rtol=1e-4)
