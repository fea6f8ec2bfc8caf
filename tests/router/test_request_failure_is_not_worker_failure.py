"""Issue 38 row 1 and 9, on the router: a worker's *answer* that one request failed (4xx/5xx) is not a dead
worker. Only what says the worker cannot be reached (connect error, timeout) takes it out of rotation, so one
hostile body can never empty the pool for everyone else. And a `max_tokens: 1` request above the
disaggregation threshold is done on the prefill worker, with no reservation and no KV transfer."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from pdcluster.worker.router.flow import Chunk, Tokenized
from pdcluster.worker.router.upstream import NoCapacity, UpstreamError

from .fakes import DECODE, DECODE2, PREFILL, Lines, Script, make_flow, tokens

PROMPT = [5, 6, 7, 8]
BOMB = {"messages": [{"role": "user", "content": "x"}], "guided_json": "[" * 3000}


def answer(status: int, message: str = "boom") -> Any:
    async def h(_: httpx.Request, __: dict[str, Any]) -> httpx.Response:
        return httpx.Response(status, json={"error": {"message": message, "type": "internal_error", "code": None}})
    return h


def refuse_connection() -> Any:
    async def h(request: httpx.Request, __: dict[str, Any]) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)
    return h


def healthy(flow: Any) -> dict[str, bool]:
    return {w.url: w.healthy for w in flow.pool.workers.values()}


async def test_tokenize_answered_500_marks_no_worker_unhealthy() -> None:
    s = Script()
    for w in (DECODE, DECODE2, PREFILL):
        s.on(w, "/internal/tokenize", answer(500, "RecursionError"))
    flow = make_flow(s, decode=(DECODE, DECODE2))
    with pytest.raises(UpstreamError) as e:
        await flow.tokenize("chat", BOMB)
    assert e.value.status == 500  # the worker's answer, passed on; the router adds no 503 no_workers of its own
    assert all(healthy(flow).values()), healthy(flow)
    # retried on at most max_retries more workers, never the whole pool over and over
    assert len([c for c in s.calls if c[1] == "/internal/tokenize"]) <= flow.max_retries + 1


async def test_tokenize_answered_400_is_the_clients_error_at_once() -> None:
    s = Script()
    s.on(DECODE, "/internal/tokenize", answer(400, "guided_json: JSON nested more than 32 levels deep"))
    flow = make_flow(s)
    with pytest.raises(UpstreamError) as e:
        await flow.tokenize("chat", BOMB)
    assert e.value.status == 400 and all(healthy(flow).values())
    assert len([c for c in s.calls if c[1] == "/internal/tokenize"]) == 1


async def test_tokenize_unreachable_worker_is_marked_and_the_next_one_answers() -> None:
    s = Script()
    s.on(DECODE, "/internal/tokenize", refuse_connection())

    async def ok(_: httpx.Request, __: dict[str, Any]) -> httpx.Response:
        return httpx.Response(200, json={"prompt_token_ids": PROMPT, "params": {"max_tokens": 2}, "model": "m"})

    s.on(DECODE2, "/internal/tokenize", ok)
    flow = make_flow(s, decode=(DECODE, DECODE2), prefill=())
    tok = await flow.tokenize("completions", {"prompt": "a"})
    assert tok.prompt_token_ids == PROMPT
    assert healthy(flow) == {DECODE: False, DECODE2: True}


async def test_reserve_answered_500_keeps_the_decode_worker_in_rotation() -> None:
    s = Script()
    s.on(DECODE, "/internal/reserve", answer(500))
    flow = make_flow(s, threshold=0)
    with pytest.raises(NoCapacity):
        await flow._reserve("r-1", PROMPT, {"max_tokens": 4}, None, set())
    assert all(healthy(flow).values())


async def test_a_4xx_in_a_workers_stream_goes_to_the_client_without_retries() -> None:
    s = Script()

    async def gen(_: httpx.Request, __: dict[str, Any]) -> httpx.Response:
        return httpx.Response(200, stream=Lines([{"error": "token 5 does not fit the grammar", "finished": True,
                                                  "finish_reason": "error", "status": 400}]))

    s.on(DECODE, "/internal/generate", gen)
    flow = make_flow(s, threshold=10_000)
    with pytest.raises(UpstreamError) as e:
        async for _ in flow.run("r", Tokenized(PROMPT, {"max_tokens": 3}, "m")):
            pass
    assert e.value.status == 400 and flow.retries == 0 and all(healthy(flow).values())


async def test_max_tokens_1_above_the_threshold_is_done_at_prefill_without_a_transfer() -> None:
    s = Script()

    async def gen(_: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        assert body["params"]["max_tokens"] == 1
        return httpx.Response(200, stream=Lines(tokens(10, 1)))

    s.on(PREFILL, "/internal/generate", gen)
    flow = make_flow(s, threshold=0)
    out: list[Chunk] = []
    async with asyncio.timeout(5):
        async for c in flow.run("r", Tokenized(PROMPT, {"max_tokens": 1}, "m")):
            out.append(c)
    assert [t for c in out for t in c.token_ids] == [10] and out[-1].finished
    assert [p for _, p, _ in s.calls] == ["/internal/generate"]  # no /internal/reserve, prefill, decode
    p = flow.pool.get("prefill", PREFILL)
    assert p.in_flight == 0 and p.outstanding_prompt_tokens == 0


async def test_a_request_ending_at_its_first_token_releases_the_decode_reservation() -> None:
    # EOS or a stop as the first token (max_tokens > 1): the decode side's blocks must not wait for its reaper
    s = Script()

    async def reserve(_: httpx.Request, __: dict[str, Any]) -> httpx.Response:
        return httpx.Response(200, json={"transfer_port": 9})

    async def prefill(_: httpx.Request, __: dict[str, Any]) -> httpx.Response:
        return httpx.Response(200, stream=Lines([{"event": "first_token", "token_id": 2, "text": "", "finished": True,
                                                  "finish_reason": "stop"}]))

    s.on(DECODE, "/internal/reserve", reserve)
    s.on(PREFILL, "/internal/prefill", prefill)
    flow = make_flow(s, threshold=0)
    async with asyncio.timeout(5):
        out = [c async for c in flow.run("r", Tokenized(PROMPT, {"max_tokens": 8}, "m"))]
    assert out[-1].finished and out[-1].finish_reason == "stop"
    await asyncio.gather(*flow._background)  # the release is a detached task: wait for it to finish
    assert [b["request_id"] for base, p, b in s.calls if p == "/internal/cancel"] == ["r-1"]
    assert flow.pool.get("decode", DECODE).in_flight == 0
