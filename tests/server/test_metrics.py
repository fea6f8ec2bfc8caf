"""WorkerMetrics: every DESIGN.md series, labelled by role, gauges read from engine.stats() at scrape."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pdcluster.worker.api.metrics import SERIES, WorkerMetrics

from .sse import first_event


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_all_series_exist_with_role_label() -> None:
    m = WorkerMetrics("prefill", cluster="demo")
    text = m.render().decode()
    names = {fam.name for fam in text_string_to_metric_families(text)}
    for series in SERIES:
        assert series.removesuffix("_total") in names, series
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith("pdcluster_"):
            assert all(s.labels.get("role") == "prefill" and s.labels.get("pdcluster") == "demo" for s in fam.samples)


def test_feeding_and_scrape_time_gauges() -> None:
    stats: dict[str, Any] = {"requests_waiting": 2, "requests_swapped": 1, "requests_running": 3,
                             "kv_cache_used_blocks": 10, "kv_cache_total_blocks": 40, "preemptions_total": 4}
    m = WorkerMetrics("decode", CollectorRegistry(), stats_fn=lambda: stats)
    m.request_accepted(7)
    m.tokens_generated(5)
    m.observe_ttft(0.2)
    m.observe_tpot(0.01)
    m.kv_transfer(1000, 0.05)
    m.kv_transfer_failed()
    m.rejected("queue_full")
    role = (("role", "decode"),)
    s = samples(m.render().decode())
    assert s[("pdcluster_requests_total", role)] == 1
    assert s[("pdcluster_prompt_tokens_total", role)] == 7
    assert s[("pdcluster_generation_tokens_total", role)] == 5
    assert s[("pdcluster_time_to_first_token_seconds_count", role)] == 1
    assert s[("pdcluster_time_per_output_token_seconds_sum", role)] == 0.01
    assert s[("pdcluster_kv_transfer_bytes_total", role)] == 1000
    assert s[("pdcluster_kv_transfer_seconds_count", role)] == 1
    assert s[("pdcluster_kv_transfer_failures_total", role)] == 1
    assert s[("pdcluster_requests_rejected_total", (("reason", "queue_full"), *role))] == 1
    assert s[("pdcluster_requests_waiting", role)] == 3  # waiting + swapped
    assert s[("pdcluster_requests_running", role)] == 3
    assert s[("pdcluster_kv_cache_used_blocks", role)] == 10
    assert s[("pdcluster_kv_cache_usage_ratio", role)] == 0.25
    assert s[("pdcluster_preemptions_total", role)] == 4
    stats["kv_cache_used_blocks"] = 0  # fresh at every scrape
    assert samples(m.render().decode())[("pdcluster_kv_cache_used_blocks", role)] == 0


def test_broken_stats_do_not_break_the_scrape() -> None:
    def boom() -> dict[str, Any]:
        raise RuntimeError("engine busy")

    text = WorkerMetrics("both", stats_fn=boom).render().decode()
    assert 'pdcluster_kv_cache_used_blocks{role="both"} 0.0' in text


def test_metrics_endpoint_during_a_request(client: httpx.Client) -> None:
    body = {"prompt": "abc", "max_tokens": 40, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        first_event(r)
        s = samples(client.get("/metrics").text)
        assert s[("pdcluster_requests_running", (("role", "decode"),))] == 1
        assert s[("pdcluster_kv_cache_used_blocks", (("role", "decode"),))] > 0
