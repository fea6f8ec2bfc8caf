"""A worker's engine state under the Gateway API Inference Extension's default metric names (the vLLM names its
endpoint picker reads), equal to the pdcluster_* series they mirror; the router exports none of them."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pdcluster.worker.api.metrics import WorkerMetrics

STATS = {"requests_waiting": 3, "requests_swapped": 1, "requests_running": 5, "kv_cache_total_blocks": 200,
         "kv_cache_used_blocks": 50, "kv_cache_usage_ratio": 0.25, "kv_cache_block_size": 16}


def _samples(m: WorkerMetrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def test_worker_exports_the_gie_names_from_its_engine_state() -> None:
    got = _samples(WorkerMetrics("decode", stats_fn=lambda: STATS, model_name="demo", process=False))
    assert got["vllm:num_requests_waiting"] == [({"model_name": "demo"}, 4.0)]  # swapped-out requests queue too
    assert got["vllm:num_requests_running"] == [({"model_name": "demo"}, 5.0)]
    assert got["vllm:kv_cache_usage_perc"] == [({"model_name": "demo"}, 0.25)]
    assert got["vllm:cache_config_info"] == [({"block_size": "16", "num_gpu_blocks": "200"}, 1.0)]
    assert got["pdcluster_requests_waiting"][0][1] == 4.0 and got["pdcluster_kv_cache_usage_ratio"][0][1] == 0.25


def test_the_router_is_no_model_server() -> None:
    got = _samples(WorkerMetrics("router", stats_fn=lambda: {"waiting": 2, "running": 1}, process=False))
    assert not [n for n in got if n.startswith("vllm:")] and got["pdcluster_requests_waiting"][0][1] == 2.0
