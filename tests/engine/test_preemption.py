"""Running out of KV blocks: preempted requests (swap or recompute) produce exactly the unpreempted tokens."""

from __future__ import annotations

import pytest

from pdcluster.worker.engine.sampling_params import SamplingParams

from .conftest import prompt_of

PROMPTS = [prompt_of(n, seed=n) for n in (20, 9, 33, 14, 25, 17)]
PARAMS = [
    SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
    SamplingParams(
        max_tokens=30, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True
    ),  # seeded sampling too
]


def _reference(make_engine):
    engine = make_engine(block_size=8, num_kv_blocks=256)
    return [engine.generate(PROMPTS, p) for p in PARAMS]


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_preemption_gives_identical_output(make_engine, mode):
    expected = _reference(make_engine)
    # 6 requests of up to 63 tokens need ~45 blocks of 8; 20 blocks force preemption.
    engine = make_engine(block_size=8, num_kv_blocks=20, preemption_mode=mode)
    for p, want in zip(PARAMS, expected, strict=True):
        before = engine.stats()["preemptions_total"]
        assert engine.generate(PROMPTS, p) == want
        assert engine.stats()["preemptions_total"] > before
    if mode == "swap":
        assert engine.runner._host_cache is not None  # really went through host memory


def test_swap_falls_back_to_recompute_without_swap_space(make_engine):
    expected = _reference(make_engine)
    engine = make_engine(block_size=8, num_kv_blocks=20, preemption_mode="swap", swap_space=0)
    assert engine.host_block_manager is None
    assert engine.generate(PROMPTS, PARAMS[0]) == expected[0]
    assert engine.stats()["preemptions_total"] > 0


def test_auto_picks_by_cost(make_engine):
    engine = make_engine(block_size=8, num_kv_blocks=20)
    engine.add_request("r", prompt_of(30), PARAMS[0])
    seq = engine.seqs["r"]
    seq.block_table = [0, 1, 2, 3]
    engine.config.host_bandwidth = 1e15  # swapping is free
    assert engine._cheaper_preemption(seq) == "swap"
    engine.config.host_bandwidth = 1.0  # swapping takes forever
    assert engine._cheaper_preemption(seq) == "recompute"
    seq.block_table = []
    engine.abort("r")


def test_request_larger_than_cache_is_rejected(make_engine):
    engine = make_engine(block_size=8, num_kv_blocks=4)
    with pytest.raises(ValueError, match="cache"):
        engine.add_request("big", prompt_of(30), SamplingParams(max_tokens=10))
