"""CPU decode attention: small attention runs on one intra-op thread, the mask is built once per step as an
additive bias (absent when every row is full), and both leave greedy output and logits as they were."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pdcluster.worker.engine import attention
from pdcluster.worker.engine.intra_op import (
    SINGLE_THREAD_POSITIONS,
    decode_attention_threads,
    intra_op_threads,
)
from pdcluster.worker.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_thread_decision() -> None:
    assert decode_attention_threads(1, "cpu") == 1
    assert decode_attention_threads(SINGLE_THREAD_POSITIONS, "cpu") == 1
    assert decode_attention_threads(SINGLE_THREAD_POSITIONS + 1, "cpu") is None  # no evidence there
    assert decode_attention_threads(8, "cuda") is None


def test_thread_scope_restores_even_on_error() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with intra_op_threads(1):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), intra_op_threads(1):
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 2
        with intra_op_threads(None), intra_op_threads(4):  # never raises the count
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_decode_attention_runs_on_one_thread(make_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*a: Any, **kw: Any) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return sdpa(*a, **kw)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = make_engine()
        engine.add_request("a", list(range(5, 25)), GREEDY)
        engine.step()  # prefill: not the decode path
        monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
        engine.step()
        assert seen and set(seen) == {1}  # every layer's decode attention
        assert torch.get_num_threads() == 2  # and the GEMMs get the configured threads back
        while engine.has_unfinished():
            engine.step()
    finally:
        torch.set_num_threads(before)


def test_bias_only_for_ragged_batches(make_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    masks: list[torch.Tensor | None] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*a: Any, **kw: Any) -> torch.Tensor:
        if a[0].dim() == 4:  # decode: [seqs, heads, 1, d] (prefill queries are [heads, len, d])
            masks.append(kw.get("attn_mask"))
        return sdpa(*a, **kw)

    engine = make_engine()
    engine.add_request("same-1", list(range(5, 25)), GREEDY)
    engine.add_request("same-2", list(range(7, 27)), GREEDY)
    engine.step()
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    engine.step()
    assert masks and all(m is None for m in masks)  # equal lengths: nothing to mask
    while engine.has_unfinished():
        engine.step()
    masks.clear()
    engine.add_request("short", list(range(5, 10)), GREEDY)
    engine.add_request("long", list(range(5, 40)), GREEDY)
    while not masks:
        engine.step()
    bias = masks[0]
    assert bias is not None and bias.dtype == torch.float32 and bias.shape == (2, 1, 1, 36)
    assert torch.isinf(bias[0, 0, 0, 6:]).all() and (bias[0, 0, 0, :6] == 0).all() and (bias[1] == 0).all()
    while engine.has_unfinished():
        engine.step()


def test_ragged_decode_logits_equal_the_boolean_mask(make_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The additive bias and the gather by index_select give the same bits as the boolean mask and
    advanced indexing they replace."""

    def old_decode(self: attention.Attention, q: torch.Tensor, md: Any, cache: Any) -> torch.Tensor:
        b, d, kvh = q.shape[0], self.head_dim, cache.kv_heads
        k = cache.k[self.layer].view(-1, kvh, d)[md.gather_slots]
        v = cache.v[self.layer].view(-1, kvh, d)[md.gather_slots]
        o = F.scaled_dot_product_attention(q.view(b, self.num_heads, 1, d), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=md.gather_mask, scale=self.scale, enable_gqa=True)
        return o.view(b, self.num_heads, d)

    logits: dict[str, list[torch.Tensor]] = {}
    for name in ("new", "old"):
        if name == "old":
            monkeypatch.setattr(attention.Attention, "_decode", old_decode)
        engine = make_engine(debug_logits=True)
        engine.add_request("short", list(range(5, 12)), GREEDY)
        engine.add_request("long", list(range(5, 45)), GREEDY)
        got: list[torch.Tensor] = []
        while engine.has_unfinished():
            got += [o.extra["logits"] for o in engine.step()]
        logits[name] = got
    assert len(logits["new"]) == len(logits["old"]) == 12
    for a, b in zip(logits["new"], logits["old"], strict=True):
        assert torch.equal(a, b)
