"""Sampling: greedy, top-k / top-p masks, and per-request seeds reproducible regardless of batch."""

from __future__ import annotations

import torch
from pdcluster.worker.engine.sampler import _filter, sample
from pdcluster.worker.engine.sampling_params import SamplingParams

from .conftest import prompt_of


def test_greedy_and_filters():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert sample(logits, [SamplingParams(temperature=0)], [None]) == [1]
    assert torch.isinf(_filter(logits[0], 2, 1.0)).tolist() == [True, False, True, False]
    # probs ~ [.03, .64, .09, .24]: nucleus 0.7 keeps the top two
    assert torch.isinf(_filter(logits[0], 0, 0.7)).tolist() == [True, False, True, False]
    assert torch.isinf(_filter(logits[0], 0, 0.5)).tolist() == [True, False, True, True]
    for _ in range(20):
        tok = sample(logits, [SamplingParams(temperature=1.0, top_k=2)], [torch.Generator().manual_seed(_)])[
            0
        ]
        assert tok in (1, 3)


def test_seeded_requests_are_reproducible_whatever_the_batch(make_engine):
    engine = make_engine()
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = engine.generate([prompt_of(9)], p)[0]
    others = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    batch = engine.generate([prompt_of(30, seed=1), prompt_of(9), prompt_of(3, seed=2)], [others, p, others])
    assert batch[1] == alone
    different = engine.generate(
        [prompt_of(9)], SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True)
    )
    assert different[0] != alone
