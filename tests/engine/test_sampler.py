"""Sampling: greedy, top-k / top-p masks, and per-request seeds reproducible regardless of batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdcluster.worker.engine.sampler import _filter, sample, token_seed
from pdcluster.worker.engine.sampling_params import SamplingParams
from tests.kv_read import export_kv

from .conftest import prompt_of


def test_greedy_and_filters():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert sample(logits, [SamplingParams(temperature=0)], [None]) == [1]
    assert torch.isinf(_filter(logits[0], 2, 1.0)).tolist() == [True, False, True, False]
    # probs ~ [.03, .64, .09, .24]: nucleus 0.7 keeps the top two
    assert torch.isinf(_filter(logits[0], 0, 0.7)).tolist() == [True, False, True, False]
    assert torch.isinf(_filter(logits[0], 0, 0.5)).tolist() == [True, False, True, True]
    for _ in range(20):
        tok = sample(logits, [SamplingParams(temperature=1.0, top_k=2, seed=_)], [0])[0]
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


def test_token_seed_is_a_pure_function_of_seed_and_index():
    seeds = {token_seed(s, i) for s in (0, 1, -1, 2**63, 1234) for i in range(50)}
    assert len(seeds) == 250  # no collisions between neighbouring seeds / indices
    assert all(0 <= x < 2**63 for x in seeds)
    assert token_seed(1234, 7) == token_seed(1234, 7)
    logits = torch.randn(1, 50)
    p = SamplingParams(temperature=1.0, seed=5)
    draws = [sample(logits, [p], [i])[0] for i in range(40)]
    assert draws == [sample(logits, [p], [i])[0] for i in range(40)]  # same (seed, index): same token
    assert len(set(draws)) > 5  # different index: a different draw, not the same noise again


SEEDED = SamplingParams(max_tokens=10, temperature=1.0, seed=4321, ignore_eos=True)


def test_seeded_resume_at_output_index_k_continues_the_single_run(make_engine):
    """A worker resuming a stream (prompt + the k tokens already delivered, first_output_index=k) draws what
    the single worker drew from token k on."""
    engine = make_engine()
    prompt = prompt_of(11, seed=3)
    alone = engine.generate([prompt], SEEDED)[0]
    for k in (1, 4):
        rest = dataclasses.replace(SEEDED, max_tokens=SEEDED.max_tokens - k, first_output_index=k)
        assert engine.generate([prompt + alone[:k]], rest)[0] == alone[k:]


def test_seeded_disaggregated_equals_single_worker(make_engine):
    """Prefill worker samples output token 0, the decode worker continues at 1: the same tokens as one
    engine alone (before, the decode worker's generator restarted and re-drew token 0's noise)."""
    prompt = prompt_of(23, seed=8)
    alone = make_engine().generate([prompt], SEEDED)[0]
    prefill = make_engine(block_size=8)
    prefill.add_request("r", prompt, SEEDED, prefill_only=True)
    first = prefill.step()[0].new_token_ids[0]
    kv = [export_kv(prefill, "r", layer) for layer in range(prefill.model_config.num_layers)]
    prefill.release("r")
    decode = make_engine(block_size=32)
    assert decode.reserve_for_import("r", prompt, SEEDED)
    for layer, (k, v) in enumerate(kv):
        decode.import_kv_layer("r", layer, k, v)
    decode.commit_import("r", first)
    got = []
    while decode.has_unfinished():
        for out in decode.step():
            got += out.new_token_ids
    assert got == alone


def _h(prompt=(), output=(), stop=()):  # noqa: ANN001, ANN202
    from pdcluster.worker.engine.sampler import History

    return History(list(prompt), list(output), set(stop))


def test_penalties_follow_vllm_formulas():
    from pdcluster.worker.engine.sampler import shape_logits

    row = torch.tensor([2.0, -1.0, 0.5, 3.0])
    p = SamplingParams(repetition_penalty=2.0)
    # tokens seen in prompt or output: positive logits divided, negative multiplied
    assert shape_logits(row, p, _h(prompt=[0], output=[1]), 0).tolist() == [1.0, -2.0, 0.5, 3.0]
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    # output only (not the prompt): minus 0.5 per occurrence, minus 0.25 once
    assert shape_logits(row, p, _h(prompt=[2], output=[3, 3, 0]), 0).tolist() == [1.25, -1.0, 0.5, 1.75]
    # the greedy pick follows the shaped logits: token 3 penalised below token 0
    p = SamplingParams(temperature=0, frequency_penalty=2.0)
    assert sample(row[None], [p], [1], [_h(output=[3])]) == [0]


def test_logit_bias_and_min_tokens():
    from pdcluster.worker.engine.sampler import shape_logits

    row = torch.tensor([5.0, 1.0, 0.0])
    p = SamplingParams(temperature=0, logit_bias={2: 10.0})
    assert sample(row[None], [p], [0], [_h()]) == [2]
    p = SamplingParams(temperature=0, min_tokens=2, max_tokens=4)
    # token 0 (a stop id) is masked for output tokens 0 and 1, allowed from token 2 on
    assert sample(row[None], [p], [1], [_h(stop=[0])]) == [1]
    assert sample(row[None], [p], [2], [_h(stop=[0])]) == [0]
    assert shape_logits(row, p, _h(stop=[0]), 0)[0] == float("-inf")


def test_logprobs_are_of_the_raw_logits():
    from pdcluster.worker.engine.sampler import logprobs_of

    row = torch.tensor([1.0, 2.0, 3.0])
    lp, top = logprobs_of(row, 0, 2)
    want = torch.log_softmax(row, -1)
    assert lp == pytest.approx(float(want[0]))
    assert [t for t, _ in top] == [2, 1] and top[0][1] == pytest.approx(float(want[2]))


def test_min_tokens_and_penalties_in_the_engine(make_engine):
    engine = make_engine()
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ref = engine.generate([prompt_of(9)], greedy)[0]
    stop_first = dataclasses.replace(greedy, stop_token_ids=[ref[0]])
    assert engine.generate([prompt_of(9)], stop_first)[0] == [ref[0]]
    held = engine.generate([prompt_of(9)], dataclasses.replace(stop_first, min_tokens=3))[0]
    assert len(held) >= 3 and ref[0] not in held[:3]
    # a strong frequency penalty forbids repeating a token greedy decoding would repeat
    rep = engine.generate([prompt_of(9)], dataclasses.replace(greedy, max_tokens=12, frequency_penalty=2.0))[0]
    plain = engine.generate([prompt_of(9)], dataclasses.replace(greedy, max_tokens=12))[0]
    assert len(set(rep)) >= len(set(plain))
