"""Flow's retry and failover decisions against scripted workers (tests/router/fakes.py): a prefill stream that
ends after its first token, a decode worker dying mid-stream with one and with two decode workers, a decode
worker that never comes back (bounded wait, clear error), a worker that fails requests without dying, a
garbled worker reply, a client that leaves while /internal/decode is in flight (reservation released), and a
transport error with no text (the failure line still names it)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from pdcluster.worker.router.flow import Chunk, Tokenized
from pdcluster.worker.router.upstream import UpstreamError

from .fakes import DECODE, DECODE2, PREFILL, Lines, Script, make_flow, ndjson, tokens

PROMPT = [5, 6, 7, 8]


def tok(max_tokens: int) -> Tokenized:
    return Tokenized(PROMPT, {"max_tokens": max_tokens, "temperature": 0.0}, "tiny")


async def collect(flow: Any, max_tokens: int, timeout: float = 5.0) -> list[Chunk]:
    out: list[Chunk] = []
    async with asyncio.timeout(timeout):
        async for c in flow.run("r", tok(max_tokens)):
            out.append(c)
    return out


async def settle(cond: Any, timeout: float = 2.0) -> None:
    """Detached cleanup (a cancel call) runs as its own task: give it a moment, then assert."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert cond()


def ids(chunks: list[Chunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def reserve_ok() -> Any:
    async def h(_: httpx.Request, __: dict[str, Any]) -> httpx.Response:
        return httpx.Response(200, json={"transfer_port": 9})
    return h


def prefill_events(*events: dict[str, Any]) -> Any:
    async def h(_: httpx.Request, __: dict[str, Any]) -> httpx.Response:
        return httpx.Response(200, content=ndjson(*events))
    return h


def streamed(items: list[Any]) -> Any:
    async def h(_: httpx.Request, __: dict[str, Any]) -> httpx.Response:
        return httpx.Response(200, stream=Lines(list(items)))
    return h


def resume_from(prompt_len: int, end: int) -> Any:
    """A decode worker's /internal/generate that continues greedy decoding from what it was given."""
    async def h(_: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        start = 10 + len(body["prompt_token_ids"]) - prompt_len
        assert body["params"]["max_tokens"] == end - start + 1
        return httpx.Response(200, stream=Lines(tokens(start, end - start + 1)))
    return h


FIRST = {"event": "first_token", "token_id": 10, "text": "<10>", "finished": False}
DONE = {"event": "transferred", "seconds": 0.01, "bytes": 1}


async def test_prefill_stream_ending_after_first_token_is_retried_not_500() -> None:
    # issue 10: `transferred` was unbound when the prefill stream ended after the first token
    s = Script()
    s.on(PREFILL, "/internal/prefill", prefill_events(FIRST))
    s.on(DECODE, "/internal/reserve", reserve_ok())
    s.on(DECODE, "/internal/generate", resume_from(len(PROMPT), 13))
    flow = make_flow(s, threshold=0)
    assert ids(await collect(flow, 4)) == [10, 11, 12, 13]
    assert flow.retries == 1 and flow.resumes == 1
    await settle(lambda: "/internal/cancel" in s.paths(DECODE))  # the unused reservation is given back


async def test_garbled_worker_reply_is_a_worker_failure_not_500() -> None:
    s = Script()
    replies = [httpx.Response(200, content=b"this is not json\n"), None]

    async def gen(req: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        r = replies.pop(0)
        return r if r is not None else await resume_from(len(PROMPT), 12)(req, body)

    s.on(DECODE, "/internal/generate", gen)
    flow = make_flow(s, threshold=10_000)
    assert ids(await collect(flow, 3)) == [10, 11, 12]
    assert flow.retries == 1


@pytest.mark.parametrize("n_decode", [1, 2])
async def test_decode_death_mid_stream_resumes_on_a_healthy_decode_worker(n_decode: int) -> None:
    s = Script()
    s.on(PREFILL, "/internal/prefill", prefill_events(FIRST, DONE))
    s.on(DECODE, "/internal/reserve", reserve_ok())
    s.on(DECODE, "/internal/decode", streamed([*tokens(11, 2, final=False), httpx.ReadError("connection reset")]))
    decodes = (DECODE, DECODE2)[:n_decode]
    flow = make_flow(s, threshold=0, decode=decodes)
    if n_decode == 2:
        flow.pool.get("decode", DECODE2).free_blocks = -1  # ranked after DECODE: the first pick is DECODE
        s.on(DECODE2, "/internal/generate", resume_from(len(PROMPT), 19))
    healthy_at: list[float] = []

    async def restart() -> None:  # the launcher restarts the dead worker; a probe re-admits it
        await asyncio.sleep(0.3)
        s.on(DECODE, "/internal/generate", resume_from(len(PROMPT), 19))
        flow.pool.get("decode", DECODE).healthy = True
        healthy_at.append(time.monotonic())
        flow.pool._changed.set()

    restarter = asyncio.ensure_future(restart())
    chunks = await collect(flow, 10)
    resumed_at = time.monotonic()
    await restarter
    assert ids(chunks) == list(range(10, 20)) and chunks[-1].finished
    assert flow.resumes == 1
    resumed_on = [b for b, p, _ in s.calls if p == "/internal/generate"]
    if n_decode == 1:
        assert resumed_on == [DECODE]
        assert resumed_at - healthy_at[0] < 0.5  # resumed as soon as the worker was back
    else:
        assert resumed_on == [DECODE2]  # did not wait for the dead one


async def test_no_decode_worker_comes_back_ends_with_a_clear_error_within_the_bound() -> None:
    s = Script()
    s.on(DECODE, "/internal/generate", streamed([*tokens(10, 2, final=False), httpx.ReadError("connection reset")]))
    flow = make_flow(s, threshold=10_000, decode_wait=0.5)
    got: list[Chunk] = []
    t0 = time.monotonic()
    with pytest.raises(UpstreamError) as e:
        async with asyncio.timeout(5):
            async for c in flow.run("r", tok(10)):
                got.append(c)
    assert ids(got) == [10, 11]
    assert time.monotonic() - t0 >= 0.4  # it waited for a decode worker to come back (the bound: the 5 s timeout)
    assert e.value.status == 503 and e.value.body["error"]["code"] == "no_decode_worker"
    assert "decode" in e.value.body["error"]["message"]


async def test_decode_worker_failing_requests_without_dying_is_retried_on_it() -> None:
    s = Script()
    replies = [httpx.Response(200, content=ndjson({"error": "engine step failed", "finished": True,
                                                   "finish_reason": "error"})), None]

    async def gen(req: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        r = replies.pop(0)
        return r if r is not None else await resume_from(len(PROMPT), 12)(req, body)

    s.on(DECODE, "/internal/generate", gen)
    flow = make_flow(s, threshold=10_000)
    assert ids(await collect(flow, 3)) == [10, 11, 12]  # the only decode worker, still healthy: used again


async def test_client_leaving_during_decode_call_releases_the_reservation() -> None:
    # issue 15 item 7a: the client goes while /internal/decode is in flight; the worker may never start that
    # stream (so it never cleans up), so the router must tell it to release the reservation
    s = Script()
    entered = asyncio.Event()

    async def hang(_: httpx.Request, __: dict[str, Any]) -> httpx.Response:
        entered.set()
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    s.on(PREFILL, "/internal/prefill", prefill_events(FIRST, DONE))
    s.on(DECODE, "/internal/reserve", reserve_ok())
    s.on(DECODE, "/internal/decode", hang)
    flow = make_flow(s, threshold=0)

    async def client() -> None:
        async for _ in flow.run("r", tok(10)):
            pass

    task = asyncio.ensure_future(client())
    await asyncio.wait_for(entered.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await settle(lambda: "/internal/cancel" in s.paths(DECODE))
    cancels = [b["request_id"] for b_, p, b in s.calls if b_ == DECODE and p == "/internal/cancel"]
    assert cancels == ["r-1"]


async def test_a_textless_transport_error_still_names_what_broke(caplog: pytest.LogCaptureFixture) -> None:
    # httpx's timeouts often carry no text: the attempt-failed line and the worker's last_error must still
    # say what happened (seen under overload as "attempt N failed: decode worker ...: " and nothing more)
    s = Script()
    s.on(DECODE, "/internal/generate", streamed([*tokens(10, 1, final=False), httpx.ReadTimeout("")]))
    flow = make_flow(s, threshold=10_000, max_retries=0)
    with caplog.at_level("WARNING"), pytest.raises(UpstreamError):
        await collect(flow, 3)
    failed = [r.getMessage() for r in caplog.records if "attempt 1 failed" in r.getMessage()]
    assert failed and failed[0].endswith("ReadTimeout")
    assert flow.pool.get("decode", DECODE).last_error == "ReadTimeout"
