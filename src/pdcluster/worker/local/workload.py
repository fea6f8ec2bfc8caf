"""A mixed workload against any OpenAI endpoint (router or worker), measured as the client sees it.

Used by `pdcluster up --demo` and the colocated-vs-disaggregated benchmark: a few long prompts arriving
among many short ones, each streamed, with TTFT (request sent -> first token) and TPOT ((last token - first
token) / (tokens - 1)) recorded per request. Prompts are token ids so the figures do not depend on a tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True)
class Req:
    prompt_len: int
    max_tokens: int
    arrival: float  # seconds after the start


@dataclass
class Result:
    prompt_len: int
    max_tokens: int
    ok: bool
    status: int = 0
    ttft: float | None = None
    tpot: float | None = None
    tokens: int = 0
    error: str | None = None


@dataclass
class Summary:
    requests: int
    ok: int
    rejected_429: int
    errors: int
    wall_s: float
    output_tokens: int
    throughput_tok_s: float
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    short_ttft_p99: float | None = None
    long_ttft_p99: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no data."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def mixed(n_short: int = 24, n_long: int = 4, short_len: tuple[int, int] = (16, 48), long_len: int = 600,
          short_out: int = 32, long_out: int = 8, rate: float = 6.0, seed: int = 0) -> list[Req]:
    """Poisson arrivals at `rate`/s; long prompts spread evenly among the short ones."""
    rng = random.Random(seed)
    total = n_short + n_long
    long_at = {round((i + 0.5) * total / n_long) for i in range(n_long)} if n_long else set()
    t, reqs = 0.0, []
    for i in range(total):
        t += rng.expovariate(rate) if rate > 0 else 0.0
        if i in long_at:
            reqs.append(Req(long_len, long_out, t))
        else:
            reqs.append(Req(rng.randint(*short_len), short_out, t))
    return reqs


def prompt_ids(n: int, salt: int, vocab: int = 900) -> list[int]:
    # distinct per request so the prefix cache does not make prefill free
    return [(salt * 7919 + i * 31) % vocab + 3 for i in range(n)]


async def one(client: httpx.AsyncClient, url: str, r: Req, salt: int) -> Result:
    body = {"prompt": prompt_ids(r.prompt_len, salt), "max_tokens": r.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    res = Result(r.prompt_len, r.max_tokens, ok=False)
    t0 = time.perf_counter()
    first = last = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                res.error = resp.text[:200]
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    res.error = str(d["error"].get("message"))
                    return res
                n = len(d["choices"][0].get("token_ids") or [])
                if n:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    res.tokens += n
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.ok = first is not None
    if first is not None:
        res.ttft = first - t0
        if res.tokens > 1 and last is not None:
            res.tpot = (last - first) / (res.tokens - 1)
    return res


async def run(url: str, reqs: list[Req], timeout: float = 600.0) -> tuple[Summary, list[Result]]:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        start = time.perf_counter()

        async def fire(i: int, r: Req) -> Result:
            await asyncio.sleep(max(0.0, start + r.arrival - time.perf_counter()))
            return await one(client, url, r, salt=i + 1)

        results = list(await asyncio.gather(*(fire(i, r) for i, r in enumerate(reqs))))
        wall = time.perf_counter() - start
    return summarize(results, wall), results


def summarize(results: list[Result], wall: float) -> Summary:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    long_cut = max((r.prompt_len for r in results), default=0) // 2
    tokens = sum(r.tokens for r in ok)
    return Summary(
        requests=len(results), ok=len(ok), rejected_429=sum(r.status == 429 for r in results),
        errors=sum(not r.ok and r.status != 429 for r in results), wall_s=wall, output_tokens=tokens,
        throughput_tok_s=tokens / wall if wall > 0 else 0.0,
        ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99),
        tpot_p50=percentile(tpot, 50), tpot_p99=percentile(tpot, 99),
        short_ttft_p99=percentile([r.ttft for r in ok if r.ttft is not None and r.prompt_len <= long_cut], 99),
        long_ttft_p99=percentile([r.ttft for r in ok if r.ttft is not None and r.prompt_len > long_cut], 99),
    )


def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f} ms"
