"""The prefix-routing benchmark's pure parts: lengths shrunk so prefix blocks stay shareable, interleaving
windows, the workers' prefix counters, and the summary."""

from __future__ import annotations

import random

import pytest

from benchmarks import prefix_routing as pr
from pdcluster.bench import trace as tr
from pdcluster.bench.replay import prompt_ids
from pdcluster.bench.stats import RequestResult
from pdcluster.worker.engine.block_hash import prompt_block_hashes


def trace(*reqs: tr.Request) -> tr.Trace:
    return tr.Trace(tuple(reqs), "mooncake", "t")


def test_shrink_keeps_prefix_blocks_whole_kv_blocks_and_clips_long_prompts() -> None:
    t = trace(tr.Request(0.0, 1024, 64, (0, 1)), tr.Request(1.0, 1536, 64, (0, 1, 2)),
              tr.Request(2.0, 500_000, 640, (0, 7)))
    s = pr.shrink(t, 64, 2048)
    assert s.block_tokens == 8
    assert [(r.input_tokens, r.output_tokens) for r in s.requests] == [(16, 1), (24, 1), (2038, 10)]
    # the two first requests share two 8-token blocks: with KV blocks of 8, two cacheable blocks in common
    a, b = (prompt_ids(r, s.block_tokens, random.Random(i)) for i, r in enumerate(s.requests[:2]))
    ha, hb = prompt_block_hashes(a + [0], 8), prompt_block_hashes(b, 8)
    assert ha[:2] == hb[:2]
    with pytest.raises(ValueError):
        pr.shrink(t, 0.5, 2048)


def test_windows_cover_the_trace_once_in_order() -> None:
    t = trace(*(tr.Request(float(i), 10, 1) for i in range(10)))
    parts = pr.windows(t, 3)
    assert sum(len(p.requests) for p in parts) == 10
    assert all(p.requests[0].t < 3.0 for p in parts)  # each re-based to its own start
    with pytest.raises(ValueError):
        pr.windows(t, 0)


def test_prefix_counters_sum_the_exposition_and_skip_created_series() -> None:
    text = ("# HELP pdcluster_prefix_cache_query_tokens_total x\n"
            'pdcluster_prefix_cache_query_tokens_total{role="prefill"} 300.0\n'
            'pdcluster_prefix_cache_hit_tokens_total{role="prefill"} 120.0\n'
            'pdcluster_prefix_cache_hit_tokens_created{role="prefill"} 1.7e9\n')
    assert pr.prefix_counters(text) == (300.0, 120.0)


def test_summary_hit_rates_and_percentiles() -> None:
    res = [RequestResult(ok=True, ttft=t, latency=t + 1, output_tokens=3) for t in (0.1, 0.2, 0.3)]
    res.append(RequestResult(ok=False, error="timeout"))
    s = pr.summarize(res, {"prefill": [200.0, 50.0], "all": [0.0, 0.0]}, {"prefix_expected_tokens": 40})
    assert s["ok"] == 3 and s["errors"] == 1 and s["prefill_hit_rate"] == 0.25 and s["all_hit_rate"] is None
    assert s["ttft_p50_s"] == 0.2 and s["router_expected_tokens"] == 40
    assert "| prefix |" in pr.table({"policies": {"prefix": s}})


@pytest.mark.parametrize("flag", [["--speedup", "nan"], ["--windows", "0"], ["--port", "99999"],
                                  ["--length-divisor", "0.5"], ["--duration", "-1"], ["--threads", "0"]])
def test_nonsense_flags_are_refused_before_anything_starts(flag: list[str], tmp_path: object) -> None:
    with pytest.raises(SystemExit) as e:
        pr.main(["--out", str(tmp_path), *flag])
    assert e.value.code == 2
