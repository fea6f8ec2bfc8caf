"""Request lifecycle over real HTTP: disconnects free KV blocks, queue limits, drain, timeouts, errors."""

from __future__ import annotations

import asyncio

import httpx

from pdcluster.worker.server.app import build_app

from .fake_engine import FakeEngine
from .harness import metric, raw_post, serve, wait_until
from .sse import events, first_event, parse

LONG = {"prompt": "hello", "max_tokens": 50, "ignore_eos": True}


def _idle(engine: FakeEngine) -> bool:
    s = engine.stats()
    return s["kv_cache_used_blocks"] == 0 and s["requests_running"] == 0 and s["requests_waiting"] == 0


def test_stream_disconnect_aborts_and_frees_blocks() -> None:
    engine = FakeEngine(step_delay=0.05)
    with serve(build_app(engine)) as url, httpx.Client(base_url=url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            first_event(r)
            assert engine.stats()["kv_cache_used_blocks"] > 0
        # leaving the block closes the connection mid-stream
        assert wait_until(lambda: _idle(engine))
        assert len(engine.aborted) == 1
        assert c.get("/health").status_code == 200


def test_non_streaming_disconnect_aborts_and_frees_blocks() -> None:
    engine = FakeEngine(step_delay=0.05)
    with serve(build_app(engine)) as url:
        sock = raw_post(url, "/v1/completions", LONG)
        assert wait_until(lambda: engine.stats()["kv_cache_used_blocks"] > 0)
        sock.close()
        assert wait_until(lambda: len(engine.aborted) == 1 and _idle(engine))


def test_disconnect_while_queued_frees_everything() -> None:
    engine = FakeEngine(step_delay=0.05, max_batch_size=1)
    with serve(build_app(engine)) as url, httpx.Client(base_url=url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as running:
            first_event(running)
            with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as queued:
                assert queued.status_code == 200
                assert wait_until(lambda: engine.stats()["requests_waiting"] == 1)
        assert wait_until(lambda: _idle(engine))
        assert len(engine.aborted) == 2


def test_concurrent_requests_all_complete() -> None:
    engine = FakeEngine(max_batch_size=3)

    async def main(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            reqs = [
                c.post("/v1/completions", json={"prompt": [i + 1], "max_tokens": 5, "stream": i % 2 == 0})
                for i in range(10)
            ]
            return await asyncio.gather(*reqs)

    with serve(build_app(engine)) as url:
        responses = asyncio.run(main(url))
    for i, r in enumerate(responses):
        assert r.status_code == 200
        expected = "".join(chr(ord("a") + (i + 1 + k) % 26) for k in range(5))
        if i % 2 == 0:
            text = "".join(e["choices"][0]["text"] for e in parse(r.text) if e != "[DONE]")
        else:
            text = r.json()["choices"][0]["text"]
        assert text == expected
    assert _idle(engine) and not engine.aborted


def test_full_queue_is_429_with_retry_after() -> None:
    engine = FakeEngine(step_delay=0.05, max_batch_size=1)
    with serve(build_app(engine, max_queue_depth=1)) as url, httpx.Client(base_url=url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as running:
            first_event(running)  # running, not waiting
            with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as queued:
                assert queued.status_code == 200  # admitted: the queue had room
                r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                assert r.status_code == 429
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["type"] == "rate_limit_error"
                metrics = c.get("/metrics").text
                assert metric(metrics, "pdcluster_requests_rejected_total", reason="queue_full", role="both") == 1.0
        assert wait_until(lambda: _idle(engine))
        # with the queue empty again the server accepts work
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_queue_bound_holds_under_a_burst() -> None:
    # Batch of 1 and a queue of 2: of a simultaneous burst, at most 1 running + 2 waiting get in
    # (a 3rd waiting slot frees only once the first request has produced its first token).
    engine = FakeEngine(step_delay=0.05, max_batch_size=1)

    async def burst(url: str) -> list[int]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            reqs = [c.post("/v1/completions", json={"prompt": "a", "max_tokens": 10}) for _ in range(8)]
            return [r.status_code for r in await asyncio.gather(*reqs)]

    with serve(build_app(engine, max_queue_depth=2)) as url:
        codes = asyncio.run(burst(url))
    assert set(codes) <= {200, 429}
    assert 2 <= codes.count(200) <= 3, codes
    assert _idle(engine)


def test_drain_finishes_in_flight_and_refuses_new_work() -> None:
    engine = FakeEngine(step_delay=0.02)
    with serve(build_app(engine)) as url, httpx.Client(base_url=url, timeout=30) as c:
        assert c.get("/health").json()["status"] == "ok"
        with c.stream("POST", "/v1/completions", json={"prompt": "a", "max_tokens": 20, "stream": True}) as r:
            first = first_event(r)
            d = c.post("/drain")
            assert d.status_code == 200 and d.json()["in_flight"] == 1
            h = c.get("/health")
            assert h.status_code == 503 and h.json()["status"] == "draining"
            refused = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
            rest = events(r)  # the in-flight request still completes
        assert rest[-1] == "[DONE]"
        assert rest[-2]["choices"][0]["finish_reason"] == "length"
        assert len(first["choices"][0]["text"] + "".join(e["choices"][0]["text"] for e in rest[:-1])) == 20
        waited = c.post("/drain", params={"wait": "true", "timeout": "5"})
        assert waited.json() == {"status": "draining", "in_flight": 0, "idle": True, "in_flight_at_drain": 0}


def test_timeout_is_504_and_frees_blocks() -> None:
    engine = FakeEngine(step_delay=0.05)
    with serve(build_app(engine, request_timeout=0.3)) as url, httpx.Client(base_url=url, timeout=30) as c:
        r = c.post("/v1/completions", json=LONG)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        assert wait_until(lambda: _idle(engine))
        with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as s:
            evs = events(s)
        assert evs[-1] == "[DONE]" and evs[-2]["error"]["code"] == "timeout"
        assert wait_until(lambda: _idle(engine))
        assert len(engine.aborted) == 2


def test_engine_error_mid_stream_is_an_error_event() -> None:
    engine = FakeEngine()
    engine.fail_after = 2
    with serve(build_app(engine)) as url, httpx.Client(base_url=url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as s:
            evs = events(s)
        assert [e["choices"][0]["text"] for e in evs[:2]] == ["a", "b"]
        assert "boom" in evs[2]["error"]["message"] and evs[3] == "[DONE]"
        r = c.post("/v1/completions", json=LONG)
        assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
        engine.fail_after = None
        assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200


async def test_not_ready_before_startup() -> None:
    # Without the lifespan having run (no startup), the worker is not ready.
    app = build_app(FakeEngine())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
        h = await c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "starting"
        r = await c.post("/v1/completions", json={"prompt": "a"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"


def test_health_and_role(client: httpx.Client) -> None:
    h = client.get("/health")
    assert h.status_code == 200 and h.json()["role"] == "decode"

