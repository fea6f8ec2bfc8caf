"""Streaming OpenAI-completions load generator: closed loop (fixed concurrency) or open loop (Poisson).

Every request streams, so TTFT and TPOT are timed per request as a client sees them, including the
router hop, queueing and (disaggregated) the KV transfer. Nothing here raises on a bad server: every
failure becomes a `RequestResult(ok=False, error=<kind>)` and is counted by the caller.

Prompts are token-id lists of the exact requested length, with `ignore_eos` and `max_tokens` so output
lengths are exact too. A server that rejects those (HTTP 400) is probed down a ladder of simpler
request shapes, ending with a plain text prompt whose length is then only approximate.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlparse

import httpx

from pdcluster.bench.stats import RequestResult

# Request shapes, richest first. `ids`: prompt as token ids; `ext`: our extensions + usage in stream.
SHAPES: list[dict] = [
    {"ids": True, "ext": True},
    {"ids": True, "ext": False},
    {"ids": False, "ext": True},
    {"ids": False, "ext": False},
]
# Common English words are one token in nearly every BPE vocabulary, so n words ~ n tokens.
_WORDS = "the of and to in is for on that with as by at from this be are was it an or not".split()


class BadURL(ValueError):
    pass


def completions_url(url: str) -> str:
    """Accept http://host:port, .../v1 or .../v1/completions; return the completions endpoint."""
    u = urlparse(url.strip())
    if u.scheme not in ("http", "https") or not u.netloc:
        raise BadURL(f"not an http(s) URL: {url!r} (expected e.g. http://127.0.0.1:8000)")
    path = u.path.rstrip("/")
    if path.endswith("/v1/completions"):
        return url.strip().rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return f"{u.scheme}://{u.netloc}{path}/v1/completions"


def base_url(url: str) -> str:
    return completions_url(url)[: -len("/v1/completions")]


def make_prompt_ids(n: int, rng: random.Random, lo: int = 5, hi: int = 250) -> list[int]:
    # Low ids exist in every vocabulary (byte-level bases); random so no prefix cache helps.
    return [rng.randrange(lo, hi) for _ in range(n)]


def make_prompt_text(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def build_payload(
    prompt_len: int,
    output_len: int,
    rng: random.Random,
    shape: dict,
    model: str | None = None,
    token_id_range: tuple[int, int] = (5, 250),
) -> dict:
    p: dict = {
        "prompt": make_prompt_ids(prompt_len, rng, *token_id_range)
        if shape["ids"]
        else make_prompt_text(prompt_len, rng),
        "max_tokens": output_len,
        "temperature": 0.0,
        "stream": True,
    }
    if shape["ext"]:
        p["ignore_eos"] = True
        p["return_token_ids"] = True
        p["stream_options"] = {"include_usage": True}
    if model:
        p["model"] = model
    return p


def count_chunk_tokens(chunk: dict) -> int:
    """Tokens carried by one SSE chunk of /v1/completions.

    token_ids (our `return_token_ids` extension) are exact. Otherwise one chunk is one token, except
    the closing chunk many servers send with empty text and a finish_reason, which carries none.
    """
    choices = chunk.get("choices") or []
    if not choices:
        return 0
    c = choices[0]
    ids = c.get("token_ids")
    if isinstance(ids, list):
        return len(ids)
    text = c.get("text") or ""
    if not text and c.get("finish_reason"):
        return 0
    return 1


def _error_message(body: bytes) -> str:
    try:
        err = json.loads(body).get("error", {})
        return str(err.get("message", err))[:200]
    except Exception:
        return body[:200].decode(errors="replace")


async def stream_one(
    client: httpx.AsyncClient, url: str, payload: dict, timeout: float, clock=time.perf_counter
) -> RequestResult:
    """Send one streaming completion and time it. Never raises (except cancellation)."""
    t0 = clock()
    res = RequestResult(ok=False, start=t0)
    try:
        await asyncio.wait_for(_stream_into(client, url, payload, res, t0, clock), timeout)
    except TimeoutError:
        res.error, res.detail = "timeout", f"no complete reply within {timeout:.0f}s"
    except httpx.ConnectError as e:
        res.error, res.detail = "connect", str(e)[:200]
    except httpx.TimeoutException as e:
        res.error, res.detail = "timeout", type(e).__name__
    except httpx.HTTPError as e:  # protocol errors, remote disconnects mid-stream
        res.error, res.detail = "transport", f"{type(e).__name__}: {e}"[:200]
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # unparsable SSE
        res.error, res.detail = "protocol", f"{type(e).__name__}: {e}"[:200]
    if res.error:
        res.ok = False
    return res


async def _stream_into(client, url, payload, res: RequestResult, t0: float, clock) -> None:
    usage_tokens: int | None = None
    usage_prompt: int | None = None
    n_tokens = 0
    last = None
    async with client.stream("POST", url, json=payload) as resp:
        if resp.status_code >= 400:
            body = await resp.aread()
            res.error, res.detail = f"http_{resp.status_code}", _error_message(body)
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments, `event:` lines
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if not isinstance(chunk, dict):
                raise ValueError("SSE data is not a JSON object")
            if "error" in chunk:
                err = chunk["error"]
                res.error = "stream_error"
                res.detail = str(err.get("message", err) if isinstance(err, dict) else err)[:200]
                return
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens", usage_tokens)
                usage_prompt = chunk["usage"].get("prompt_tokens", usage_prompt)
            k = count_chunk_tokens(chunk)
            if k:
                now = clock()
                if res.ttft is None:
                    res.ttft = now - t0
                elif last is not None:
                    res.itl.append(now - last)
                last = now
                n_tokens += k
    res.latency = (last if last is not None else clock()) - t0
    res.output_tokens = usage_tokens if usage_tokens is not None else n_tokens
    prompt = payload.get("prompt")
    res.prompt_tokens = usage_prompt if usage_prompt is not None else (
        len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
    )
    if res.ttft is None:
        res.error, res.detail = "empty", "stream ended without a token"
        return
    res.ok = True


@dataclass
class Probe:
    shape: dict | None  # None: nothing the server accepted
    result: RequestResult


async def probe_shape(client: httpx.AsyncClient, url: str, model: str | None, timeout: float) -> Probe:
    """Find the richest request shape the server accepts (one tiny request per rung; 400 -> next)."""
    rng = random.Random(0)
    last = RequestResult(ok=False, error="connect")
    for shape in SHAPES:
        last = await stream_one(client, url, build_payload(4, 2, rng, shape, model), timeout)
        if last.ok:
            return Probe(shape, last)
        if last.error != "http_400":  # only a rejected shape is worth another rung
            return Probe(None, last)
    return Probe(None, last)


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """Send offsets (seconds) of n requests with exponential gaps of mean 1/rate."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_requests(
    client: httpx.AsyncClient,
    url: str,
    payloads: Sequence[dict],
    *,
    concurrency: int | None = None,
    rate: float | None = None,
    seed: int = 0,
    timeout: float = 300.0,
    on_done: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Run payloads closed-loop (`concurrency` in flight) or open-loop (Poisson at `rate` req/s).

    Returns results in payload order and the wall time from first send to last reply.
    """
    results: list[RequestResult | None] = [None] * len(payloads)
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        r = await stream_one(client, url, payloads[i], timeout)
        results[i] = r
        if on_done:
            on_done(r)

    if rate is not None:
        # Open loop: arrivals do not wait for replies, so an overloaded server shows queueing
        # (rising TTFT) instead of the generator politely slowing down.
        offsets = poisson_arrivals(len(payloads), rate, random.Random(seed))
        tasks = []
        for i, off in enumerate(offsets):
            delay = t0 + off - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    else:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(len(payloads)):
            queue.put_nowait(i)

        async def worker() -> None:
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                await one(i)

        await asyncio.gather(*(worker() for _ in range(max(1, concurrency or 1))))
    wall = time.perf_counter() - t0
    return [r for r in results if r is not None], wall


def make_client(concurrency: int, timeout: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max(concurrency, 1) + 4, max_keepalive_connections=max(concurrency, 1))
    # Read timeout per chunk: a stalled stream is a timeout even before the overall deadline.
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), limits=limits, trust_env=False)


async def discover_model(client: httpx.AsyncClient, url: str) -> str | None:
    """First id from GET /v1/models, or None (the request is then sent without `model`)."""
    try:
        r = await client.get(base_url(url) + "/v1/models", timeout=10.0)
        if r.status_code == 200:
            data = r.json().get("data") or []
            if data and isinstance(data[0], dict):
                return data[0].get("id")
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return None
