"""Backpressure and deadlines at the router: a bounded queue answers 429 + Retry-After (never 5xx) and a
request past --request-timeout gets a 504; neither leaks KV blocks or hurts later requests."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from .harness import cluster, idle_everywhere, metric


async def burst(url: str, n: int, max_tokens: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(i: int) -> httpx.Response:
            return await client.post("/v1/completions", json={
                "prompt": [5 + i] * (20 + i), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        return list(await asyncio.gather(*(one(i) for i in range(n))))


@pytest.mark.slow
def test_overload_gives_429_not_5xx_and_timeouts_give_504(tiny_model_dir: Path) -> None:
    with cluster(tiny_model_dir, threshold=0, max_queue_depth=2, request_timeout=60) as c:
        rs = asyncio.run(burst(c.router, 24, 24))
        codes = [r.status_code for r in rs]
        assert set(codes) <= {200, 429}, codes
        assert 429 in codes and 200 in codes
        r429 = next(r for r in rs if r.status_code == 429)
        assert int(r429.headers["Retry-After"]) >= 1 and r429.json()["error"]["code"] == "queue_full"
        assert metric(c.router, "pdcluster_requests_rejected_total") >= codes.count(429)
        assert httpx.get(f"{c.router}/health").status_code == 200
        assert all(r.status_code == 200 for r in asyncio.run(burst(c.router, 2, 4)))
        loads = idle_everywhere(c)
        assert all(d["used_blocks"] == 0 for d in loads), loads

        c.state.request_timeout = 0.2  # read per request: the same cluster, now with a tight deadline
        r = httpx.post(f"{c.router}/v1/completions", timeout=60, json={
            "prompt": [7] * 10, "max_tokens": 1000, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        # streamed: the deadline ends the stream with an error event, then [DONE]
        r = httpx.post(f"{c.router}/v1/completions", timeout=60, json={
            "prompt": [7] * 10, "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True})
        events = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert '"timeout"' in events[-2] and events[-1] == "data: [DONE]"
        loads = idle_everywhere(c)
        assert all(d["used_blocks"] == 0 for d in loads), loads


@pytest.mark.slow
def test_no_free_blocks_on_decode_queues_instead_of_failing(tiny_model_dir: Path) -> None:
    """8 blocks of 16 tokens on every worker: one 100-token request fills the decode worker's cache, so the
    others' reservations get 429 (never an OOM) and the router waits for room; all complete."""
    with cluster(tiny_model_dir, threshold=0, prefill_blocks=(16,), decode_blocks=(16,), num_kv_blocks=8) as c:
        async def go() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=c.router, timeout=120) as client:
                return list(await asyncio.gather(*(client.post("/v1/completions", json={
                    "prompt": [9 + i] * 100, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
                    for i in range(3))))

        rs = asyncio.run(go())
        assert [r.status_code for r in rs] == [200, 200, 200], [r.text for r in rs]
        assert metric(c.decode[0], "pdcluster_requests_rejected_total") >= 1  # reservations refused meanwhile
        loads = idle_everywhere(c)
        assert all(d["used_blocks"] == 0 for d in loads), loads


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_client_that_gives_up_frees_everything(tiny_model_dir: Path, stream: bool) -> None:
    """A client leaving mid-request (non-streamed: its read timeout; streamed: it closes after a few chunks)
    aborts the work on the workers: no running request, no used block, nothing in flight at the router."""
    body = {"prompt": [7] * 30, "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": stream}
    with cluster(tiny_model_dir, threshold=0) as c:
        # Non-streamed, the client gives up by its 0.1 s read timeout (900 engine steps take longer); streamed,
        # it leaves after 5 chunks, so its reads may wait as long as a loaded machine needs for the first one.
        read = 30.0 if stream else 0.1
        with httpx.Client(timeout=httpx.Timeout(read, connect=5)) as client:
            if stream:
                with client.stream("POST", f"{c.router}/v1/completions", json=body) as r:
                    for n, _ in enumerate(r.iter_lines()):
                        if n >= 5:
                            break  # leaving the block closes the connection mid-stream
            else:
                with pytest.raises(httpx.ReadTimeout):
                    client.post(f"{c.router}/v1/completions", json=body)
        loads = idle_everywhere(c, timeout=30)
        assert all(d["used_blocks"] == 0 and d["running"] == 0 for d in loads), loads
        assert httpx.get(f"{c.router}/cluster").json()["router"]["in_flight"] == 0
        # stopped early, not merely finished: 900 engine steps take far longer than the abort's round trip
        assert metric(c.decode[0], "pdcluster_generation_tokens_total") < 800
