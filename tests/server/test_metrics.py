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
    m.decode_joined(0.03)
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
    assert s[("pdcluster_decode_join_seconds_sum", role)] == 0.03
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
        labels = (("model_name", "fake"), ("role", "decode"))  # a worker labels its series with its model
        assert s[("pdcluster_requests_running", labels)] == 1
        assert s[("pdcluster_kv_cache_used_blocks", labels)] > 0


def test_no_created_series_and_process_collectors() -> None:
    text = WorkerMetrics("both", model_name="m").render().decode()
    assert "_created" not in text  # half the series, for a timestamp nobody queries
    assert "process_resident_memory_bytes" in text and "python_info" in text


def test_phases_lengths_finish_reasons_and_prefix_counters() -> None:
    stats = {"prefix_cache_query_tokens": 100, "prefix_cache_hit_tokens": 48}
    m = WorkerMetrics("both", CollectorRegistry(), stats_fn=lambda: stats, model_name="m")
    m.phase("prefill_queue", 0.25)
    m.phase("prefill_compute", 0.5)
    m.request_finished("length", 300, 17, 2.0)
    m.request_finished("weird", 1, 0)  # an unknown reason is counted as an abort, not a new series
    m.build_info("1.2.3", {"block_size": 16})
    s = samples(m.render().decode())
    lab = (("model_name", "m"), ("role", "both"))
    assert s[("pdcluster_request_phase_seconds_sum", (("model_name", "m"), ("phase", "prefill_queue"),
                                                       ("role", "both")))] == 0.25
    assert s[("pdcluster_request_success_total", (("finish_reason", "length"),) + lab)] == 1
    assert s[("pdcluster_request_success_total", (("finish_reason", "abort"),) + lab)] == 1
    assert s[("pdcluster_request_success_total", (("finish_reason", "stop"),) + lab)] == 0  # exists from start
    assert s[("pdcluster_request_prompt_tokens_bucket", (("le", "512.0"),) + lab)] == 2
    assert s[("pdcluster_request_prompt_tokens_bucket", (("le", "256.0"),) + lab)] == 1
    assert s[("pdcluster_e2e_request_latency_seconds_count", lab)] == 1  # only where arrival was known
    assert s[("pdcluster_prefix_cache_query_tokens_total", lab)] == 100
    assert s[("pdcluster_prefix_cache_hit_tokens_total", lab)] == 48
    assert s[("pdcluster_build_info", (("key", "block_size"),) + lab + (("value", "16"), ("version", "1.2.3")))] == 1


def test_a_served_request_is_counted_by_phase_and_finish_reason(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3})
    assert r.status_code == 200
    s = samples(client.get("/metrics").text)
    lab = (("model_name", "fake"), ("role", "decode"))
    assert sum(v for (n, ls), v in s.items() if n == "pdcluster_request_success_total") >= 1
    assert s[("pdcluster_request_generation_tokens_count", lab)] >= 1
    assert s[("pdcluster_e2e_request_latency_seconds_count", lab)] >= 1
    assert s[("pdcluster_request_phase_seconds_count", (("model_name", "fake"), ("phase", "decode"),
                                                        ("role", "decode")))] >= 1
    assert any(n == "pdcluster_build_info" and dict(ls).get("version") for (n, ls) in s)


def test_engine_settings_reads_a_dataclass_instance_and_skips_a_dataclass_class() -> None:
    # A config that is a dataclass *class* (not an instance) has no settings: asdict would raise TypeError
    import dataclasses
    from types import SimpleNamespace

    from pdcluster.worker.server.app import engine_settings

    @dataclasses.dataclass
    class Cfg:
        block_size: int = 16
        name: str = "m"
        shapes: tuple[int, ...] = (1, 2)

    assert engine_settings(SimpleNamespace(config=Cfg())) == {"block_size": 16, "name": "m"}
    assert engine_settings(SimpleNamespace(engine=SimpleNamespace(config=Cfg()))) == {"block_size": 16, "name": "m"}
    assert engine_settings(SimpleNamespace(config=Cfg)) == {}
    assert engine_settings(SimpleNamespace(config={"block_size": 16})) == {}


def test_native_pool_counters_come_from_engine_stats() -> None:
    stats = {"native_pool_calls": 120, "native_pool_shared_calls": 100, "native_pool_stalls": 2}
    m = WorkerMetrics("decode", CollectorRegistry(), stats_fn=lambda: stats)
    s = samples(m.render().decode())
    assert s[("pdcluster_native_pool_calls_total", (("role", "decode"),))] == 120
    assert s[("pdcluster_native_pool_shared_calls_total", (("role", "decode"),))] == 100
    assert s[("pdcluster_native_pool_stalls_total", (("role", "decode"),))] == 2
    idle = samples(WorkerMetrics("decode", CollectorRegistry(), stats_fn=dict).render().decode())
    assert idle[("pdcluster_native_pool_calls_total", (("role", "decode"),))] == 0  # no kernel ran: zeros


def test_native_kernel_loaded_has_one_sample_per_module_asked_for() -> None:
    """1 where a native module runs, 0 where it could not load (the torch path runs: what an SRE alerts on);
    no sample on a worker that never asked for one (a GPU worker, the router)."""
    stats = {"native_kernel_loaded:pdc_step": 1, "native_kernel_loaded:pdc_quant": 0, "native_pool_calls": 3}
    s = samples(WorkerMetrics("decode", CollectorRegistry(), stats_fn=lambda: stats).render().decode())
    loaded = {k[1]: v for k, v in s.items() if k[0] == "pdcluster_native_kernel_loaded"}
    assert loaded == {(("kernel", "pdc_quant"), ("role", "decode")): 0.0,
                      (("kernel", "pdc_step"), ("role", "decode")): 1.0}, loaded
    idle = samples(WorkerMetrics("decode", CollectorRegistry(), stats_fn=dict).render().decode())
    assert not [k for k in idle if k[0] == "pdcluster_native_kernel_loaded"]
