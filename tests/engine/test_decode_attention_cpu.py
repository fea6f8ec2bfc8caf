"""CPU decode attention, torch path: the mask is built once per step as an additive bias (absent when every row
is full) and K/V are gathered with index_select; both leave the logits' bits as they were. The native kernel
(tests/engine/test_native_decode.py) is switched off here: these tests are about the path it replaces."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pdcluster.worker.engine import attention
from pdcluster.worker.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def _torch_decode_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention.native, "attention_available", lambda *a: False)


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
