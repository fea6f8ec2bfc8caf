"""The router in front of vLLM workers (`pdcluster router --engine vllm`): vLLM's own P/D handshake.

vLLM's NixlConnector is driven per request by `kv_transfer_params` in the OpenAI body:

1. prefill leg: the client's body to a prefill worker with `max_tokens: 1`, `stream: false` and
   `kv_transfer_params: {"do_remote_decode": true, ...}`; the worker computes the prompt's KV, keeps the blocks
   for a decode worker to read, and answers with the `kv_transfer_params` that locate them (its engine id,
   side-channel host and port, block ids, request id, TP size);
2. decode leg: the client's body, unchanged but for those `kv_transfer_params`, to a decode worker, which
   pulls the KV over NIXL and generates; its reply (a stream or one JSON) goes to the client as it is.

The router's own parts stay what they are for our engine: admission and the queue, the disaggregation
threshold (prompts below it go straight to a decode worker), prefix-aware and least-loaded picking (prompt
token ids from the worker's `/tokenize`; block size and KV blocks from its `vllm:cache_config_info`), and
retries on another pair while nothing has reached the client, and a stream whose decode worker dies resumes
on another pair after the tokens the client already has (vllm_resume.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from pdcluster.worker.api import errors
from pdcluster.worker.router import aggregate as agg
from pdcluster.worker.router.flow import Chunk
from pdcluster.worker.router.picking import pick_prefill, rank_decode, should_disaggregate
from pdcluster.worker.router.pool import Pool, Worker
from pdcluster.worker.router.upstream import describe
from pdcluster.worker.router.vllm_resume import StreamState

log = logging.getLogger(__name__)

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# What a prefill leg asks for: the KV kept for a remote decode, nothing else (one token, no stream).
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _Failed(Exception):
    """A worker broke this attempt (transport error, 5xx, a reply without what the handshake needs)."""

    def __init__(self, w: Worker, message: str) -> None:
        super().__init__(f"{w.role} worker {w.url}: {message}")
        self.worker = w


# ---- one request -------------------------------------------------------------------------------------

class VLLMFlow:
    """Tokenize (for picking), then prefill leg + decode leg, or the decode worker alone below the threshold."""

    def __init__(self, pool: Pool, *, threshold: int, max_retries: int, connect_timeout: float = 2.0,
                 decode_wait: float = 30.0, placements: agg.Placements | None = None) -> None:
        self.pool, self.threshold, self.max_retries = pool, threshold, max_retries
        # where each attempt prefilled and why (pdcluster_router_placements_total, /cluster): shared with the
        # router's own flow, so a long prompt that went to a decode worker alone says why
        self.placements = placements if placements is not None else agg.Placements()
        self.decode_wait = decode_wait  # a resume waits this long for a healthy decode worker (as Flow's)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=connect_timeout))
        self.retries = 0
        self.resumes = 0  # streams continued on another decode worker after theirs broke

    @property
    def disaggregated(self) -> int:
        """Attempts whose prompt was handed over prefill -> decode (`/cluster`'s `vllm_disaggregated`)."""
        return self.placements.counts.get((agg.DISAGGREGATED, agg.PROMPT_LENGTH), 0)

    async def close(self) -> None:
        await self.client.aclose()

    async def tokenize(self, kind: str, body: dict[str, Any]) -> list[int]:
        """The prompt's token ids from a worker's /tokenize (its answer to bad input is the client's answer)."""
        req: dict[str, Any] = {"model": body.get("model")}
        if kind == "chat":
            req.update(messages=body.get("messages"), add_generation_prompt=True)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return list(prompt)
            req["prompt"] = prompt
        for w in sorted((w for w in self.pool.workers.values() if w.healthy), key=lambda w: w.in_flight):
            try:
                r = await self.client.post(f"{w.url}/tokenize", json=req)
            except httpx.TransportError as e:
                self.pool.mark_failed(w.role, w.url, describe(e))
                continue
            if r.status_code == 200:
                tokens = r.json().get("tokens")
                if isinstance(tokens, list):
                    return [int(t) for t in tokens]
            if 400 <= r.status_code < 500:
                raise _api_error(r)
            self.pool.mark_failed(w.role, w.url, f"/tokenize: HTTP {r.status_code}")
        raise errors.unavailable("no healthy worker could take the request", code="no_workers")

    async def _prefill(self, p: Worker, kind: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """The prefill leg: the kv_transfer_params locating the prompt's KV on `p` (None: nothing to hand over,
        e.g. the request ended within its first token)."""
        leg = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
        leg.update(stream=False, max_tokens=1, n=1, kv_transfer_params=dict(REMOTE_DECODE))
        if kind == "chat" and "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        try:
            r = await self.client.post(f"{p.url}{PATHS[kind]}", json=leg)
        except httpx.TransportError as e:
            self.pool.mark_failed("prefill", p.url, describe(e))
            raise _Failed(p, describe(e)) from e
        if 400 <= r.status_code < 500:
            raise _api_error(r)
        if r.status_code != 200:
            self.pool.mark_failed("prefill", p.url, f"HTTP {r.status_code}")
            raise _Failed(p, f"HTTP {r.status_code}")
        params = r.json().get("kv_transfer_params")
        return params if isinstance(params, dict) and params else None

    async def _open(self, d: Worker, kind: str, body: dict[str, Any]) -> httpx.Response:
        """The decode leg, opened: status and headers read, the body still to stream."""
        req = self.client.build_request("POST", f"{d.url}{PATHS[kind]}", json=body)
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.TransportError as e:
            self.pool.mark_failed("decode", d.url, describe(e))
            raise _Failed(d, describe(e)) from e
        if resp.status_code != 200:
            await resp.aread()
            await resp.aclose()
            if 400 <= resp.status_code < 500:
                raise _api_error(resp)
            self.pool.mark_failed("decode", d.url, f"HTTP {resp.status_code}")
            raise _Failed(d, f"HTTP {resp.status_code}")
        return resp

    async def _attempt(self, kind: str, body: dict[str, Any], prompt: list[int],
                       excluded: set[str]) -> tuple[Worker, httpx.Response]:
        """One pair: prefill (when the prompt is long enough and a prefill worker is healthy), then decode."""
        leg = body
        prefer_node = None
        placed = (agg.AGGREGATED, agg.alone_reason(len(prompt), self.threshold))
        if should_disaggregate(len(prompt), self.threshold, any(w.healthy for w in self.pool.pool("prefill"))):
            cached = self.pool.cached_tokens("prefill", prompt)
            pv = pick_prefill(self.pool.views("prefill"), exclude=excluded, prompt_tokens=len(prompt), cached=cached)
            if pv is not None:
                p = self.pool.get("prefill", pv.url)
                p.in_flight += 1
                p.outstanding_prompt_tokens += len(prompt)
                try:
                    params = await self._prefill(p, kind, body)
                finally:
                    p.in_flight -= 1
                    p.outstanding_prompt_tokens -= len(prompt)
                self.pool.remember(p, prompt)
                if params is not None:
                    leg = {**body, "kv_transfer_params": params}
                    prefer_node = p.node
                    placed = (agg.DISAGGREGATED, agg.PROMPT_LENGTH)
                else:  # the prefill leg's request ended at its first token: no KV left to hand over
                    placed = (agg.AGGREGATED, agg.PREFILL_ENDED)
        self.placements.count(*placed)
        cached = {} if leg is not body else self.pool.cached_tokens("decode", prompt)
        ranked = rank_decode(self.pool.views("decode"), prefer_node=prefer_node, exclude=excluded, cached=cached)
        if not ranked:
            raise errors.unavailable("no healthy decode worker behind the router", code="no_decode_worker")
        d = self.pool.get("decode", ranked[0].url)
        if leg is body:
            self.pool.remember(d, prompt)
        d.in_flight += 1  # from the pick on, so concurrent picks see it; the reply's end gives it back
        try:
            return d, await self._open(d, kind, leg)
        except BaseException:
            d.in_flight -= 1
            raise

    async def respond(self, st: Any, kind: str, body: dict[str, Any], tracker: Any) -> Response:
        """One admitted request (app.py's RouterState `st`, its Tracker): metrics, the deadline up to the reply's
        start (all of a non-streamed reply), and the Tracker released when the reply has been sent."""
        owned = True
        try:
            prompt = await self.tokenize(kind, body)
            st.metrics.request_accepted(len(prompt))
            try:
                async with asyncio.timeout(st.request_timeout):
                    resp = await self.run(kind, body, prompt, lambda n: tracker.saw(Chunk([0] * n, "")))
            except TimeoutError:
                st.metrics.rejected("timeout")
                raise errors.timeout(st.request_timeout or 0.0) from None
            if isinstance(resp, StreamingResponse):
                owned = False  # the stream's end releases the request's place
                resp.background = BackgroundTask(tracker.done)
            return resp
        finally:
            if owned:
                tracker.done()

    async def _pair(self, kind: str, body: dict[str, Any], prompt: list[int],
                    excluded: set[str]) -> tuple[Worker, httpx.Response]:
        """A decode worker's open reply, retried on another pair (`max_retries`) while none answers 200."""
        failures = 0
        while True:
            try:
                return await self._attempt(kind, body, prompt, excluded)
            except _Failed as e:
                failures += 1
                self.retries += 1
                excluded.add(e.worker.url)
                log.warning("vLLM request attempt %d failed: %s", failures, e)
                if failures > self.max_retries:
                    raise errors.APIError(502, f"request failed on {failures} worker pairs; last error: {e}",
                                          code="workers_failed") from None

    async def run(self, kind: str, body: dict[str, Any], prompt: list[int], on_tokens: Any) -> Response:
        """The client's response: retried on another pair until a decode worker answers 200 (nothing has reached
        the client before that). `on_tokens(n)` is told of output tokens as they stream (TTFT/TPOT metrics)."""
        if body.get("stream"):
            state = StreamState(kind, body, prompt)
            d, resp = await self._pair(kind, state.leg_body(), prompt, set())
            return StreamingResponse(self._relay(state, d, resp, on_tokens), media_type="text/event-stream",
                                     headers=_SSE_HEADERS)
        d, resp = await self._pair(kind, body, prompt, set())
        try:
            data = json.loads(await resp.aread())
        except ValueError:
            raise errors.APIError(502, f"decode worker {d.url}: malformed reply", code="workers_failed") from None
        finally:
            d.in_flight -= 1
            await resp.aclose()
        usage = data.get("usage") if isinstance(data, dict) else None
        on_tokens(int(usage.get("completion_tokens", 0)) if isinstance(usage, dict) else 0)
        return JSONResponse(data)

    async def _relay(self, state: StreamState, d: Worker, resp: httpx.Response, on_tokens: Any
                     ) -> AsyncIterator[bytes]:
        """The decode worker's SSE to the client, line by line. A worker that breaks the stream (dies, or ends it
        without `[DONE]`) is replaced: the stream resumes on another pair after the tokens already sent
        (vllm_resume.py), at most `max_retries` times; what cannot be resumed ends with an OpenAI error event."""
        excluded: set[str] = set()
        while True:
            try:
                async for line in resp.aiter_lines():
                    out, n = state.line(line)
                    if n:
                        on_tokens(n)
                    if out is not None:
                        yield (out + "\n").encode()
                if state.done:
                    return
                failure = (f"it reported an error: {state.error}" if state.error is not None
                           else "the stream ended without [DONE]")
            except httpx.HTTPError as e:
                failure = describe(e)
                self.pool.mark_failed("decode", d.url, failure)
            finally:
                d.in_flight -= 1
                await resp.aclose()
            log.warning("vLLM decode worker %s broke a stream after %d tokens: %s", d.url, len(state.sent), failure)
            if state.finished or state.all_sent():  # everything was delivered but the stream's end
                yield "\n".join(state.closing()).encode()
                return
            excluded.add(d.url)
            why = state.blocker or (f"{state.resumed} resumes already" if state.resumed >= self.max_retries else None)
            try:
                if why:
                    raise errors.APIError(502, f"decode worker {d.url} failed mid-stream ({failure}); not resumed: "
                                               f"{why}", code="workers_failed")
                self.resumes += 1
                state.start_leg(await self._boundary(state))
                d, resp = await self._resume(state, excluded)
            except errors.APIError as err:
                yield f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n".encode()
                return

    async def _boundary(self, state: StreamState, lookback: int = 8) -> int | None:
        """How many of the tokens sent end on a character boundary (their text, from a worker's /detokenize, does
        not end in U+FFFD), looking back at most `lookback` tokens; None when no worker can say."""
        workers = [w for w in self.pool.workers.values() if w.healthy]
        for m in range(len(state.sent), max(0, len(state.sent) - lookback) - 1, -1):
            for w in workers:
                try:
                    r = await self.client.post(f"{w.url}/detokenize", timeout=10.0,
                                               json={"model": state.body.get("model"), "tokens": state.sent[:m]})
                except httpx.HTTPError:
                    continue
                if r.status_code != 200:
                    continue
                text = r.json().get("prompt")
                if not isinstance(text, str) or not text.endswith("\ufffd"):
                    return m
                break
            else:
                return None
        return None

    async def _resume(self, state: StreamState, excluded: set[str]) -> tuple[Worker, httpx.Response]:
        """The next leg of a broken stream. With no healthy decode worker (the only one died and restarts) it
        waits for one at most `decode_wait` seconds, as our engine's resume does, then gives up."""
        since = time.monotonic()
        while True:
            try:
                return await self._pair("completions", state.resume_body(), state.prompt + state.sent, excluded)
            except errors.APIError as e:
                if e.code != "no_decode_worker" or time.monotonic() - since >= self.decode_wait:
                    raise
                await self.pool.wait_changed(min(0.05, self.decode_wait))


def _api_error(r: httpx.Response) -> errors.APIError:
    """A worker's 4xx, relayed with its OpenAI error body (vLLM's are OpenAI-shaped too)."""
    try:
        err = r.json().get("error") or {}
        if isinstance(err, str):
            err = {"message": err}
    except (ValueError, AttributeError):
        err = {"message": r.text[:500]}
    status = 400 if r.status_code == 422 else r.status_code  # the house rule: invalid input is a 400
    code, param = err.get("code"), err.get("param")
    return errors.APIError(status, str(err.get("message", "invalid request")),
                           code=None if code is None else str(code), param=None if param is None else str(param))
