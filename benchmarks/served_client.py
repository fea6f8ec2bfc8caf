"""The load client of the serving benchmarks (served_vs_hf, native_attention): `batch` concurrent
/v1/completions requests to one `pdcluster serve`, their token ids, the decode rate from SSE arrival times,
and the CPU the client itself spent (it runs on the server's cores here)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import httpx

Run = tuple[list[int], float, float]  # one request's token ids, time of its first token, time of its last


async def _one(client: httpx.AsyncClient, prompt: list[int], new: int, stream: bool) -> Run:
    """(token ids, time of the first token, time of the last) of one request, through httpx."""
    body = _body(prompt, new, stream)
    if not stream:
        r = await client.post("/v1/completions", json=body)
        r.raise_for_status()
        now = time.perf_counter()
        return r.json()["choices"][0]["token_ids"], now, now
    tokens = _Tokens()
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            tokens.line(line.encode())
    return tokens.ids, tokens.first, time.perf_counter()


async def _one_aiohttp(session: aiohttp.ClientSession, prompt: list[int], new: int,
                       stream: bool) -> Run:
    """The same request through aiohttp (C HTTP parser; the client vLLM's serving benchmark uses)."""
    async with session.post("/v1/completions", json=_body(prompt, new, stream)) as r:
        r.raise_for_status()
        if not stream:
            ids = (await r.json())["choices"][0]["token_ids"]
            now = time.perf_counter()
            return ids, now, now
        tokens = _Tokens()
        async for line in r.content:
            tokens.line(line)
    return tokens.ids, tokens.first, time.perf_counter()


def _body(prompt: list[int], new: int, stream: bool) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "stream": stream}


class _Tokens:
    """Token ids of one streamed response, fed its SSE lines, and when the first arrived."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.first = 0.0

    def line(self, line: bytes) -> None:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            return
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(f"server error: {event['error']}")
        got = event["choices"][0].get("token_ids") or []
        if got and not self.first:
            self.first = time.perf_counter()
        self.ids.extend(got)


async def served_run(port: int, prompts: list[list[int]], new: int, stream: bool,
                     client: str = "aiohttp") -> tuple[float, float, list[list[int]], float]:
    """(whole-request tok/s, decode tok/s, ids, client CPU seconds) of `len(prompts)` concurrent requests. The
    client shares the server's cores here (it would not in a deployment), so its CPU is measured: httpx's
    pure-Python HTTP and line parsing cost ~3.5x aiohttp's, time taken from the served step."""
    url = f"http://127.0.0.1:{port}"
    cpu0 = _cpu()
    async with _client(client, url, len(prompts)) as one:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(p, new, stream) for p in prompts))
        wall = time.perf_counter() - t0
    cpu = _cpu() - cpu0
    b = len(prompts)
    first, last = max(r[1] for r in res), max(r[2] for r in res)
    decode = b * (new - 1) / (last - first) if stream and last > first else float("nan")
    return b * new / wall, decode, [r[0] for r in res], cpu


@contextlib.asynccontextmanager
async def _client(client: str, url: str, n: int) -> AsyncIterator[Callable[[list[int], int, bool], Awaitable[Run]]]:
    """One request's coroutine function over a connection pool of `n` + 1 for the named client."""
    if client == "httpx":
        limits = httpx.Limits(max_connections=n + 1, max_keepalive_connections=n + 1)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as hc:
            yield functools.partial(_one, hc)
    else:
        connector = aiohttp.TCPConnector(limit=n + 1)
        async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as ac:
            yield functools.partial(_one_aiohttp, ac)


def _cpu() -> float:
    # process_time reads the process's CPU clock in nanoseconds; os.times() counts 10 ms ticks, and a short run
    # (the tests' two tiny requests) could read 0.0
    return time.process_time()
