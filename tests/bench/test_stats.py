import math

import numpy as np
import pytest

from pdcluster.bench.stats import (
    CELL_FIELDS,
    RequestResult,
    parse_int_list,
    percentile,
    summarize_cell,
)


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    xs = [0.3, 0.1, 5.0, 2.2, 0.7, 0.7, 9.1]
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentile_edges():
    assert percentile([], 50) is None
    assert percentile([4.0], 99) == 4.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_tpot_is_mean_gap_after_first_token():
    r = RequestResult(ok=True, ttft=0.5, latency=1.5, output_tokens=11)
    assert r.tpot == pytest.approx(0.1)
    assert RequestResult(ok=True, ttft=0.5, latency=0.5, output_tokens=1).tpot is None
    assert RequestResult(ok=False, error="connect").tpot is None


def test_summarize_cell_counts_errors_and_excludes_them_from_latency():
    ok = [RequestResult(ok=True, ttft=0.1 * i, latency=0.1 * i + 1.0, output_tokens=11, prompt_tokens=8)
          for i in range(1, 5)]
    bad = [RequestResult(ok=False, error="http_500"), RequestResult(ok=False, error="http_500"),
           RequestResult(ok=False, error="timeout")]
    c = summarize_cell(8, 11, ok + bad, wall_seconds=2.0)
    assert set(CELL_FIELDS) <= set(c)
    assert (c["requests"], c["completed"], c["errors"]) == (7, 4, 3)
    assert c["error_kinds"] == {"http_500": 2, "timeout": 1}
    assert c["ttft_p50"] == pytest.approx(0.25)
    assert c["tpot_p50"] == pytest.approx(0.1)
    assert c["output_tokens_per_second"] == pytest.approx(44 / 2.0)
    assert c["prompt_tokens_per_second"] == pytest.approx(32 / 2.0)


def test_summarize_cell_all_failed_has_no_latency_and_zero_throughput():
    c = summarize_cell(8, 8, [RequestResult(ok=False, error="connect")] * 3, wall_seconds=0.0)
    assert c["ttft_p50"] is None and c["tpot_p99"] is None
    assert c["output_tokens_per_second"] == 0.0
    assert c["errors"] == 3 and c["error_kinds"] == {"connect": 3}
    assert not any(isinstance(v, float) and math.isnan(v) for v in c.values())


def test_parse_int_list():
    assert parse_int_list("128, 512,2048,") == [128, 512, 2048]
    for bad in ["", "a,b", "0", "-5"]:
        with pytest.raises(ValueError):
            parse_int_list(bad)
