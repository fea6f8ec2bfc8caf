"""bench/mixed_steps.py's run on the tiny model: the arrivals are timed and both schedules give the same tokens."""

from __future__ import annotations

import torch

from pdcluster.bench.mixed_steps import run
from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine


def test_run_measures_arrivals_and_schedules_agree(tiny_model_dir_no_tokenizer) -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    dec = torch.randint(3, 512, (2, 20), generator=g).tolist()
    arr = torch.randint(3, 512, (3, 20), generator=g).tolist()
    got = {}
    for mixed in (True, False):
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dir_no_tokenizer), num_kv_blocks=64,
                                        max_batch_tokens=16, mixed_steps=mixed))
        got[mixed] = run(engine, dec, arr, gap=0.0)
        assert not engine.has_unfinished()
    assert got[True]["tokens"] == got[False]["tokens"]
    assert [len(t) for t in got[True]["tokens"]] == [16, 16, 16, 64, 64]  # arrivals, then decoders
    for r in got.values():
        assert 0 < r["ttft_p50"] <= r["ttft_p90"] and 0 < r["tpot_p50"] <= r["tpot_p90"] and r["tok_s"] > 0
