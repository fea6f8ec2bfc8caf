"""Scripted workers for Flow tests: an httpx.MockTransport that answers /internal/* the way a worker does
(or breaks the way a dying one does), with no engine, no sockets and no sleeping on real I/O."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

from pdcluster.worker.router.flow import Flow
from pdcluster.worker.router.options import RouterOptions
from pdcluster.worker.router.pool import Pool

PREFILL, DECODE, DECODE2 = "http://prefill:1", "http://decode:2", "http://decode:3"
Handler = Callable[[httpx.Request, dict[str, Any]], Awaitable[httpx.Response]]


def ndjson(*events: dict[str, Any]) -> bytes:
    return b"".join((json.dumps(e) + "\n").encode() for e in events)


class Lines(httpx.AsyncByteStream):
    """A streamed body: each item is sent as one NDJSON line; an Exception item is raised there (a worker
    that dies mid-stream), an awaitable is awaited first (a worker that stalls)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for item in self.items:
            if isinstance(item, BaseException):
                raise item
            if asyncio.iscoroutine(item) or isinstance(item, asyncio.Future):
                await item
                continue
            yield ndjson(item)


def tokens(start: int, n: int, *, final: bool = True) -> list[dict[str, Any]]:
    """Greedy-looking token events start, start+1, ...; the last one is final unless `final=False` (a stream
    that is cut before its end)."""
    last = start + n - 1
    return [{"token_ids": [t], "text": f"<{t}>", "finished": final and t == last,
             "finish_reason": "length" if final and t == last else None} for t in range(start, last + 1)]


class Script:
    """Routes requests to per-(worker, path) handlers and records every call."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], Handler] = {}
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    def on(self, base: str, path: str, handler: Handler) -> None:
        self.routes[(base, path)] = handler

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        body = json.loads(request.content or b"{}")
        self.calls.append((base, request.url.path, body))
        handler = self.routes.get((base, request.url.path))
        if handler is None:
            return httpx.Response(200, json={})
        return await handler(request, body)

    def paths(self, base: str) -> list[str]:
        return [p for b, p, _ in self.calls if b == base]


def make_flow(script: Script, *, decode: tuple[str, ...] = (DECODE,), prefill: tuple[str, ...] = (PREFILL,),
              threshold: int = 0, **kw: Any) -> Flow:
    """A Flow over `script`; threshold 0 (every prompt disaggregated) unless a test says otherwise, the other
    knobs RouterOptions' (max_retries, decode_wait, ...)."""
    pool = Pool(prefill_urls=list(prefill), decode_urls=list(decode))
    for w in pool.workers.values():
        w.healthy = True
    flow = Flow(pool, RouterOptions(disaggregation_threshold=threshold, **kw))
    flow.client = httpx.AsyncClient(transport=httpx.MockTransport(script))
    return flow
