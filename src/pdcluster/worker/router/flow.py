"""One request's journey through the cluster: pick a pair, reserve, prefill + transfer, decode; retry on
another pair when a worker fails, and resume on a healthy decode worker (re-prefilling prompt + the tokens
already sent) when the decode worker dies mid-stream, so the client sees one unbroken stream. With no
healthy decode worker at all (the only one died and is restarting), the request waits at most
`decode_wait` seconds for one to come back, then ends with a clear error instead of stalling."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from pdcluster.worker.api import tracing
from pdcluster.worker.router import aggregate as agg
from pdcluster.worker.router.options import RouterOptions
from pdcluster.worker.router.picking import pick_prefill, rank_decode, should_disaggregate
from pdcluster.worker.router.pool import Pool, Worker, direct_pair
from pdcluster.worker.router.progress import Stages, Timeline
from pdcluster.worker.router.quarantine import PairQuarantine
from pdcluster.worker.router.tokenized import Chunk, Tokenized, tokenized_answer
from pdcluster.worker.router.upstream import (
    NoCapacity,
    NoHealthyDecode,
    NoTransferPath,
    UpstreamError,
    WorkerFailed,
    describe,
    error_of,
    no_decode_error,
    read_lines,
)

log = logging.getLogger(__name__)


class Flow:
    def __init__(self, pool: Pool, options: RouterOptions, *, connect_timeout: float = 2.0) -> None:
        self.pool, self.threshold, self.max_retries = pool, options.disaggregation_threshold, options.max_retries
        # How long a request may wait for any decode worker to be healthy (e.g. the only one restarting):
        # well under the request timeout, so a dead pool gives a clear error, not a silent stall.
        self.decode_wait = options.decode_wait
        # the pool's auth header (derived from the shared secret) goes on every /internal/* call
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=connect_timeout),
                                        headers=getattr(pool, "headers", {}))
        self.stages = Stages()
        self.metrics: Any = None  # the router's WorkerMetrics: request phases and finishes
        self.tool_call_parser: str | None = None  # --tool-call-parser, sent with each request to tokenize
        self.resumes = 0
        self.retries = 0
        self.quarantine = PairQuarantine()  # prefill->decode pairs whose transfers keep failing
        # prompt tokens routed to a prefilling worker, and of those, how many the router expected it to hold
        self.prefix_routed_tokens = 0
        self.prefix_expected_tokens = 0
        self._background: set[asyncio.Task[Any]] = set()
        # where each request was placed and why (pdcluster_router_placements_total), and the load rule's state
        self.ttft_slo = options.ttft_slo
        self.placements = agg.Placements()

    async def close(self) -> None:
        await self.client.aclose()

    def _routed(self, w: Worker, prompt: list[int], cached: dict[str, int]) -> None:
        """`w` prefills `prompt`: count the prefix the router expected it to hold, and remember the blocks."""
        self.prefix_expected_tokens += cached.get(w.url, 0)
        self.prefix_routed_tokens += len(prompt)
        self.pool.remember(w, prompt)

    # ------------------------------------------------------------------ tokenize
    async def tokenize(self, kind: str, body: dict[str, Any], trace: tracing.Span = tracing.NO_SPAN) -> Tokenized:
        """Validation and tokenization happen on a worker (it owns the tokenizer and the model limits).

        Only a worker that cannot be reached (connect error, timeout) is marked unhealthy. A 5xx *answer* is
        this request failing there, not a dead worker: the next worker is tried (at most `max_retries` more)
        without marking any, and the last answer goes to the client. One hostile body cannot empty the pool."""
        candidates = [w for w in self.pool.pool("decode") + self.pool.pool("prefill") if w.healthy]
        payload = {"kind": kind, "body": body, "tool_call_parser": self.tool_call_parser}
        answered: UpstreamError | None = None
        answers = 0
        for w in sorted(candidates, key=lambda w: w.in_flight):
            try:
                r = await self.client.post(f"{w.url}/internal/tokenize", json=payload, headers=trace.headers)
            except httpx.TransportError as e:
                self.pool.mark_failed(w.role, w.url, describe(e))
                continue
            if r.status_code == 200:
                return tokenized_answer(r.json())
            if r.status_code < 500:
                raise await error_of(r)
            answered, answers = await error_of(r), answers + 1
            log.warning("tokenize on %s answered HTTP %d: %s", w.url, r.status_code, str(answered.body)[:200])
            if answers > self.max_retries:
                break
        if answered is not None:
            raise answered
        raise NoCapacity("no healthy worker to tokenize the request")

    # ------------------------------------------------------------------ the request
    async def run(self, rid: str, tok: Tokenized, arrival: float | None = None) -> AsyncIterator[Chunk]:
        prompt, params = tok.prompt_token_ids, tok.params
        tl = Timeline(arrival if arrival is not None else time.monotonic(), self.metrics, tok.trace)
        sent: list[int] = []
        failures = 0
        excluded: set[str] = set()  # workers that failed this request: avoided while others are healthy
        attempt = 0
        no_decode_since: float | None = None
        while True:
            attempt += 1
            arid = f"{rid}-{attempt}"
            try:
                if sent and len(sent) >= int(params["max_tokens"]):
                    yield Chunk([], "", True, "length")  # everything was delivered; only the final flag was lost
                    return
                if sent:
                    # Resume: the new decode worker prefills prompt + what the client already has, then
                    # continues. Greedy decoding continues exactly where it stopped; seeded sampling too, as
                    # the worker draws output token k from (seed, k) (first_output_index tells it k).
                    rest = dict(params, max_tokens=int(params["max_tokens"]) - len(sent),
                                first_output_index=int(params.get("first_output_index", 0)) + len(sent))
                    self.placements.count(agg.AGGREGATED, agg.RESUME)
                    stream = self._direct(arid, prompt + sent, rest, excluded, tl)
                elif should_disaggregate(len(prompt), self.threshold, any(w.healthy for w in self.pool.pool("prefill"))):
                    done_at_prefill = int(params["max_tokens"]) <= 1
                    stream = (self._at_prefill(arid, prompt, params, excluded, tl) if done_at_prefill
                              else self._placed(arid, prompt, params, excluded, tl))
                else:
                    self.placements.count(agg.AGGREGATED, agg.alone_reason(len(prompt), self.threshold))
                    stream = self._direct(arid, prompt, params, excluded, tl)
                async with contextlib.aclosing(stream) as chunks:  # type: ignore[type-var]
                    async for c in chunks:
                        no_decode_since = None
                        sent.extend(c.token_ids)
                        if c.finished:
                            tl.finished(c.finish_reason, len(prompt), len(sent))
                        yield c
                        if c.finished:
                            return
                raise WorkerFailed("decode", "?", "stream ended without a final chunk")
            except (WorkerFailed, httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                # A worker broke this attempt (died, errored, or answered something malformed): count it
                # and try again; never let a worker's bad reply become the client's 500.
                if not isinstance(e, WorkerFailed):
                    e = WorkerFailed("worker", "?", f"malformed reply: {type(e).__name__}: {e}")
                failures += 1
                self.retries += 1
                excluded.add(e.url)
                log.warning("request %s attempt %d failed: %s", rid, attempt, e)
                tl.trace.event("attempt_failed", {"pdcluster.attempt": attempt, "error": str(e)[:200]})
                if failures > self.max_retries:
                    raise UpstreamError(502, {"error": {
                        "message": f"request failed on {failures} worker pairs; last error: {e}",
                        "type": "upstream_error", "code": "workers_failed"}}) from e
                self.resumes += bool(sent)  # the next attempt continues a stream the client already sees
            except NoHealthyDecode:
                # The decode pool is empty for now (its only worker died and is restarting, or all drain):
                # resume the moment one is healthy again, but give up after `decode_wait`.
                now = time.monotonic()
                no_decode_since = now if no_decode_since is None else no_decode_since
                if now - no_decode_since >= self.decode_wait:
                    raise no_decode_error(now - no_decode_since) from None
                with self.stages.enter("queued"):
                    await self.pool.wait_changed(min(0.05, self.decode_wait))
            except NoCapacity:
                # Not a failure: wait for capacity (a finished request or a re-admitted worker); the
                # caller's deadline bounds the wait.
                with self.stages.enter("queued"):
                    await self.pool.wait_changed(0.05)

    # ------------------------------------------------------------------ one attempt, disaggregated
    async def _reserve(self, arid: str, prompt: list[int], params: dict[str, Any], prefer_node: str | None,
                       excluded: set[str], headers: Any = None, prefill: Worker | None = None
                       ) -> tuple[Worker, dict[str, Any]]:
        """A decode worker holding blocks for the prompt, and where the prefill worker sends its KV (the
        `target` of /internal/prefill)."""
        views = self.pool.views("decode")
        blocked = self.quarantine.blocked(prefill.url) if prefill is not None else set()
        # a pair in quarantine is skipped while another decode worker can take the request
        ranked = rank_decode(views, prefer_node=prefer_node, exclude=excluded | blocked) if blocked else []
        ranked = ranked or rank_decode(views, prefer_node=prefer_node, exclude=excluded)
        if not ranked:
            raise NoHealthyDecode("no healthy decode worker")
        no_transfer = 0
        for view in ranked:
            w = self.pool.get("decode", view.url)
            w.in_flight += 1  # counted from now, so concurrent picks see it; the caller keeps it on success
            ok = False
            try:
                body: dict[str, Any] = {"request_id": arid, "prompt_token_ids": prompt, "params": params}
                if prefill is not None and direct_pair(prefill, w):  # each TP rank sends its own KV heads
                    body["prefill_tp"] = prefill.tensor_parallel_size
                r = await self.client.post(f"{w.url}/internal/reserve", headers=headers, json=body)
                ok = r.status_code == 200
            except httpx.TransportError as e:
                self.pool.mark_failed("decode", w.url, describe(e))
                continue
            except asyncio.CancelledError:
                # Deadline or client gone while the reservation was in flight: it may have succeeded on the
                # worker, so release it now rather than leave it to the worker's reaper.
                self._detach(self._cancel(w, arid))
                raise
            finally:
                if not ok:
                    w.in_flight -= 1
            if ok:
                answer = r.json()
                target: dict[str, Any] = {"host": w.host, "port": int(answer["transfer_port"])}
                if isinstance(answer.get("rank_ports"), list) and "prefill_tp" in body:
                    target["rank_ports"] = [int(p) for p in answer["rank_ports"]]
                return w, target
            if r.status_code == 400:
                raise await error_of(r)
            if r.status_code == 503 and (await error_of(r)).body.get("error", {}).get("code") == "no_transfer":
                no_transfer += 1
            elif r.status_code >= 500:  # an answer: this reservation failed there, the worker is alive
                log.warning("reserve on %s answered HTTP %d", w.url, r.status_code)
        if ranked and no_transfer == len(ranked):
            raise NoTransferPath()
        raise NoCapacity("no decode worker has free KV blocks")

    def _pick_prefill(self, prompt: list[int], excluded: set[str]) -> tuple[Worker, dict[str, int]] | None:
        """The prefill worker for this prompt (and what each worker is believed to cache of it), or None when no
        prefill worker can take it: the caller then runs the request on a decode worker."""
        cached = self.pool.cached_tokens("prefill", prompt)
        pv = pick_prefill(self.pool.views("prefill"), exclude=excluded, prompt_tokens=len(prompt), cached=cached)
        return None if pv is None else (self.pool.get("prefill", pv.url), cached)

    def _placed(self, arid: str, prompt: list[int], params: dict[str, Any], excluded: set[str],
                tl: Timeline) -> AsyncIterator[Chunk]:
        """A prompt the length rule disaggregates, unless the prefill queue would miss the TTFT target and a
        decode worker has the slack to prefill it now (router/aggregate.py)."""
        placed = self._by_load(prompt, params, excluded)
        if placed is None or not placed.aggregate:
            return self._disaggregated(arid, prompt, params, excluded, tl,
                                       reason=agg.PROMPT_LENGTH if placed is None else placed.reason)
        self.placements.count(agg.AGGREGATED, agg.PREFILL_BACKLOG)
        # only the worker that has the slack (and the KV room); if it refuses, the next attempt decides again
        others = {w.url for w in self.pool.pool("decode")} - {placed.decode}
        return self._direct(arid, prompt, params, excluded | others, tl)

    def _by_load(self, prompt: list[int], params: dict[str, Any], excluded: set[str]) -> agg.Placement | None:
        if self.ttft_slo <= 0:
            return None
        picked = self._pick_prefill(prompt, excluded)
        if picked is None:
            return None
        p, cached = picked
        on_decode = self.pool.cached_tokens("decode", prompt)
        ranked = rank_decode(self.pool.views("decode"), exclude=excluded, cached=on_decode)
        slack = [agg.slack_of(self.pool.get("decode", v.url), len(prompt), int(params["max_tokens"]),
                              on_decode.get(v.url, 0)) for v in ranked]
        placed = agg.decide(len(prompt), agg.backlog_of(p, cached.get(p.url, 0)), slack, self.ttft_slo,
                            self.placements.engaged)
        self.placements.engaged, self.placements.last = placed.engaged, placed
        return placed

    def _detach(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cancel(self, w: Worker, arid: str) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self.client.post(f"{w.url}/internal/cancel", json={"request_id": arid}, timeout=2.0)

    async def _disaggregated(self, arid: str, prompt: list[int], params: dict[str, Any],
                             excluded: set[str], tl: Timeline | None = None,
                             reason: str = agg.PROMPT_LENGTH) -> AsyncIterator[Chunk]:
        tl = tl or Timeline(time.monotonic())
        picked = self._pick_prefill(prompt, excluded)
        if picked is None:
            self.placements.count(agg.AGGREGATED, agg.NO_PREFILL)
            async for c in self._direct(arid, prompt, params, excluded, tl):
                yield c
            return
        p, cached = picked
        try:
            d, target = await self._reserve(arid, prompt, params, p.node, excluded, tl.trace.headers, p)
        except NoTransferPath:
            self.placements.count(agg.AGGREGATED, agg.NO_TRANSFER_PATH)
            async for c in self._direct(arid, prompt, params, excluded, tl):
                yield c
            return
        self._routed(p, prompt, cached)
        self.placements.count(agg.DISAGGREGATED, reason)
        completed = False  # the decode worker's stream reached its final chunk
        at_prefill = False  # ... or the request ended at its first token: the reservation was never used
        transferred = False
        first: dict[str, Any] | None = None
        p.outstanding_prompt_tokens += len(prompt)
        p.in_flight += 1
        stage = self.stages.cursor("prefill")
        try:
            body = {"request_id": arid, "prompt_token_ids": prompt, "params": params,
                    "target": target}
            try:
                tl.mark("dispatched", "router_queue", tl.arrival)
                async with self.client.stream("POST", f"{p.url}/internal/prefill", json=body,
                                              headers=tl.trace.headers) as resp:
                    if resp.status_code != 200:
                        err = await error_of(resp)
                        if err.body.get("error", {}).get("code") == "no_transfer":  # misconfigured: skip it
                            raise WorkerFailed("prefill", p.url, "no KV transfer secret configured")
                        if resp.status_code in (429, 503):
                            raise NoCapacity(str(err))
                        if resp.status_code < 500:
                            raise err
                        raise WorkerFailed("prefill", p.url, f"HTTP {resp.status_code}")
                    async for ev in read_lines(resp, "prefill", p.url):
                        if ev.get("event") == "first_token":
                            first = ev
                            tl.mark("first_token")
                            self.pool.remember(p, prompt)  # committed there now: newer than any eviction report
                            p.outstanding_prompt_tokens -= len(prompt)
                            stage.move("transfer")
                            completed = bool(ev.get("finished"))  # the request ended at its first token
                            at_prefill = completed
                            yield Chunk([int(ev["token_id"])], str(ev.get("text") or ""), completed,
                                        ev.get("finish_reason"), ev.get("logprobs"))
                            if completed:
                                return
                        elif ev.get("event") == "transferred":
                            transferred = True
                            tl.mark("transferred", "kv_transfer", tl.first_token)
                        elif ev.get("event") == "error":
                            if ev.get("stage") == "prefill":
                                raise WorkerFailed("prefill", p.url, f"prefill: {ev.get('message')}")
                            # The transfer broke: the decode side is the usual suspect (died, timed out).
                            if self.quarantine.failed(p.url, d.url):
                                log.warning("KV transfers %s -> %s keep failing: pair in quarantine for %.0f s",
                                            p.url, d.url, self.quarantine.hold_s)
                            raise WorkerFailed("decode", d.url, f"kv transfer: {ev.get('message')}")
                    # Read to the end (not break) so the worker's stream finishes normally and releases
                    # its blocks without relying on disconnect handling.
                    if not transferred:
                        raise WorkerFailed("prefill", p.url, "prefill stream ended early")
            except httpx.TransportError as e:
                self.pool.mark_failed("prefill", p.url, describe(e))
                raise WorkerFailed("prefill", p.url, describe(e)) from e
            if first is None:
                raise WorkerFailed("prefill", p.url, "prefill stream ended without a first token")
            stage.move("decode")
            async for c in self._decode_stream(d, "/internal/decode",
                                               {"request_id": arid, "first_token_id": int(first["token_id"])},
                                               tl.trace.headers):
                tl.mark("decoding", "decode_queue", tl.transferred)
                completed = completed or c.finished  # before the yield: the consumer stops at the last one
                yield c
        finally:
            stage.move(None)
            if first is None:
                p.outstanding_prompt_tokens -= len(prompt)
            p.in_flight -= 1
            d.in_flight -= 1
            if not completed or at_prefill:
                # Failed, the client left, or it ended at prefill (EOS or a stop as its first token): release
                # the reservation (or abort the decode) now. The decode worker may never have started its
                # /internal/decode stream, and then nothing on its side would free the blocks before the reaper.
                self._detach(self._cancel(d, arid))

    async def _at_prefill(self, arid: str, prompt: list[int], params: dict[str, Any], excluded: set[str],
                          tl: Timeline) -> AsyncIterator[Chunk]:
        """A request that ends at its first token (`max_tokens: 1`: scoring, classification, another stack's
        prefill leg) leaves no KV worth moving: the prefill worker runs it whole on /internal/generate. No
        reservation, no transfer racing the release of the prefill blocks, nothing for the decode side to wait
        for."""
        picked = self._pick_prefill(prompt, excluded)
        if picked is None:
            self.placements.count(agg.AGGREGATED, agg.NO_PREFILL)
            async for c in self._direct(arid, prompt, params, excluded, tl):
                yield c
            return
        p, cached = picked
        self._routed(p, prompt, cached)
        self.placements.count(agg.AT_PREFILL, agg.SINGLE_TOKEN)
        p.outstanding_prompt_tokens += len(prompt)
        p.in_flight += 1
        body = {"request_id": arid, "prompt_token_ids": prompt, "params": params}
        try:
            with self.stages.enter("prefill"):
                tl.mark("dispatched", "router_queue", tl.arrival)
                async for c in self._decode_stream(p, "/internal/generate", body, tl.trace.headers, role="prefill"):
                    if c.token_ids:
                        tl.mark("first_token")
                    yield c
        finally:
            p.in_flight -= 1
            p.outstanding_prompt_tokens -= len(prompt)

    # ------------------------------------------------------------------ one attempt, decode worker only
    async def _direct(self, arid: str, prompt: list[int], params: dict[str, Any],
                      excluded: set[str], tl: Timeline | None = None) -> AsyncIterator[Chunk]:
        tl = tl or Timeline(time.monotonic())
        cached = self.pool.cached_tokens("decode", prompt)
        ranked = rank_decode(self.pool.views("decode"), exclude=excluded, cached=cached)
        if not ranked:
            raise NoHealthyDecode("no healthy decode worker")
        body = {"request_id": arid, "prompt_token_ids": prompt, "params": params}
        for view in ranked:
            w = self.pool.get("decode", view.url)
            self._routed(w, prompt, cached)
            w.in_flight += 1
            try:
                with self.stages.enter("decode"):
                    tl.mark("dispatched", "router_queue", tl.arrival)
                    first = True
                    async for c in self._decode_stream(w, "/internal/generate", body, tl.trace.headers):
                        if c.token_ids:
                            tl.mark("first_token")
                            if first:  # prefilled and committed there: newer than any eviction report
                                first = False
                                self.pool.remember(w, prompt)
                        yield c
                return
            except NoCapacity:
                continue
            finally:
                w.in_flight -= 1
        raise NoCapacity("every decode worker is full")

    async def _decode_stream(self, w: Worker, path: str, body: dict[str, Any],
                             headers: Any = None, role: str = "decode") -> AsyncIterator[Chunk]:
        try:
            async with self.client.stream("POST", f"{w.url}{path}", json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    err = await error_of(resp)
                    if resp.status_code in (429, 503):
                        raise NoCapacity(str(err))
                    if resp.status_code == 409:  # reservation expired: redo the whole pair
                        raise WorkerFailed(role, w.url, "reservation expired")
                    if resp.status_code < 500:
                        raise err
                    raise WorkerFailed(role, w.url, f"HTTP {resp.status_code}")
                async for ev in read_lines(resp, role, w.url):
                    status = ev.get("status")
                    if isinstance(status, int) and 400 <= status < 500:  # the request's fault: not retried
                        raise UpstreamError(status, {"error": {"message": str(ev.get("error")),
                                                               "type": "invalid_request_error", "code": None}})
                    if ev.get("finish_reason") == "error" or (ev.get("error") and ev.get("finished")):
                        raise WorkerFailed(role, w.url, str(ev.get("error")))
                    if ev.get("finish_reason") == "abort":
                        raise WorkerFailed(role, w.url, "request aborted by the worker")
                    yield Chunk(list(ev.get("token_ids") or []), ev.get("text") or "", bool(ev.get("finished")),
                                ev.get("finish_reason"), ev.get("logprobs"))
                    if ev.get("finished"):
                        return
        except httpx.TransportError as e:
            self.pool.mark_failed(role, w.url, describe(e))
            raise WorkerFailed(role, w.url, describe(e)) from e
        raise WorkerFailed(role, w.url, "stream ended without a final chunk")
