"""One request's journey through the cluster: pick a pair, reserve, prefill + transfer, decode; retry on
another pair when a worker fails, and resume on another decode worker (re-prefilling prompt + the tokens
already sent) when the decode worker dies mid-stream, so the client sees one unbroken stream."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdcluster.worker.router.picking import pick_prefill, rank_decode, should_disaggregate
from pdcluster.worker.router.pool import Pool, Worker

log = logging.getLogger(__name__)


@dataclass
class Tokenized:
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams as a dict (the router never imports torch)
    model: str
    stream: bool = False
    return_token_ids: bool = False


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None


class WorkerFailed(Exception):
    """A worker broke this attempt; another pair may succeed."""

    def __init__(self, role: str, url: str, message: str) -> None:
        super().__init__(f"{role} worker {url}: {message}")
        self.role, self.url = role, url


class NoCapacity(Exception):
    """Every candidate refused for lack of room (429s, no KV blocks): wait and try again."""


class NoTransferPath(Exception):
    """No decode worker can receive KV (e.g. `both` workers without a transfer secret): prefill there."""


class UpstreamError(Exception):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(str(body))
        self.status, self.body = status, body


@dataclass
class Stages:
    """Requests currently in each stage; exported as pdcluster_router_requests_in_stage{stage}."""

    counts: dict[str, int] = field(default_factory=lambda: {"queued": 0, "prefill": 0, "transfer": 0, "decode": 0})

    @contextlib.contextmanager
    def enter(self, stage: str):  # type: ignore[no-untyped-def]
        self.counts[stage] += 1
        try:
            yield
        finally:
            self.counts[stage] -= 1

    def cursor(self, stage: str) -> StageCursor:
        return StageCursor(self, stage)


class StageCursor:
    """Where one request is now; `move` keeps the per-stage counts exact as it advances."""

    def __init__(self, stages: Stages, stage: str | None) -> None:
        self.stages = stages
        self.stage: str | None = None
        self.move(stage)

    def move(self, stage: str | None) -> None:
        if self.stage is not None:
            self.stages.counts[self.stage] -= 1
        self.stage = stage
        if stage is not None:
            self.stages.counts[stage] += 1


async def _lines(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in resp.aiter_lines():
        if line.strip():
            yield json.loads(line)


async def _error_of(resp: httpx.Response) -> UpstreamError:
    await resp.aread()
    try:
        body = resp.json()
    except ValueError:
        body = {"error": {"message": resp.text[:500], "type": "upstream_error", "code": None}}
    return UpstreamError(resp.status_code, body)


class Flow:
    def __init__(self, pool: Pool, *, threshold: int = 0, max_retries: int = 2, connect_timeout: float = 2.0) -> None:
        self.pool, self.threshold, self.max_retries = pool, threshold, max_retries
        # the pool's auth header (derived from the shared secret) goes on every /internal/* call
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=connect_timeout),
                                        headers=getattr(pool, "headers", {}))
        self.stages = Stages()
        self.resumes = 0
        self.retries = 0
        self._background: set[asyncio.Task[Any]] = set()

    async def close(self) -> None:
        await self.client.aclose()

    # ------------------------------------------------------------------ tokenize
    async def tokenize(self, kind: str, body: dict[str, Any]) -> Tokenized:
        """Validation and tokenization happen on a worker (it owns the tokenizer and the model limits)."""
        candidates = [w for w in self.pool.pool("decode") + self.pool.pool("prefill") if w.healthy]
        for w in sorted(candidates, key=lambda w: w.in_flight):
            try:
                r = await self.client.post(f"{w.url}/internal/tokenize", json={"kind": kind, "body": body})
            except httpx.TransportError as e:
                self.pool.mark_failed(w.role, w.url, str(e))
                continue
            if r.status_code == 200:
                d = r.json()
                return Tokenized(d["prompt_token_ids"], d["params"], d["model"], d.get("stream", False),
                                 d.get("return_token_ids", False))
            if r.status_code < 500:
                raise await _error_of(r)
            self.pool.mark_failed(w.role, w.url, f"HTTP {r.status_code}")
        raise NoCapacity("no healthy worker to tokenize the request")

    # ------------------------------------------------------------------ the request
    async def run(self, rid: str, tok: Tokenized) -> AsyncIterator[Chunk]:
        prompt, params = tok.prompt_token_ids, tok.params
        sent: list[int] = []
        failures = 0
        excluded: set[str] = set()
        attempt = 0
        while True:
            attempt += 1
            arid = f"{rid}-{attempt}"
            try:
                if sent and len(sent) >= int(params["max_tokens"]):
                    yield Chunk([], "", True, "length")  # everything was delivered; only the final flag was lost
                    return
                if sent:
                    # Resume: the new decode worker prefills prompt + what the client already has, then
                    # continues. Greedy decoding continues exactly where it stopped.
                    rest = dict(params, max_tokens=int(params["max_tokens"]) - len(sent))
                    stream = self._direct(arid, prompt + sent, rest, excluded)
                elif should_disaggregate(len(prompt), self.threshold, any(w.healthy for w in self.pool.pool("prefill"))):
                    stream = self._disaggregated(arid, prompt, params, excluded)
                else:
                    stream = self._direct(arid, prompt, params, excluded)
                async with contextlib.aclosing(stream) as chunks:  # type: ignore[type-var]
                    async for c in chunks:
                        sent.extend(c.token_ids)
                        yield c
                        if c.finished:
                            return
                raise WorkerFailed("decode", "?", "stream ended without a final chunk")
            except WorkerFailed as e:
                failures += 1
                self.retries += 1
                excluded.add(e.url)
                log.warning("request %s attempt %d failed: %s", rid, attempt, e)
                if failures > self.max_retries:
                    raise UpstreamError(502, {"error": {
                        "message": f"request failed on {failures} worker pairs; last error: {e}",
                        "type": "upstream_error", "code": "workers_failed"}}) from e
                self.resumes += bool(sent)  # the next attempt continues a stream the client already sees
                if len(excluded) >= len(self.pool.workers):
                    excluded.clear()  # everyone failed once: let the health state decide again
            except NoCapacity:
                # Not a failure: wait for capacity (a finished request or a re-admitted worker); the
                # caller's deadline bounds the wait.
                with self.stages.enter("queued"):
                    await self.pool.wait_changed(0.05)

    # ------------------------------------------------------------------ one attempt, disaggregated
    async def _reserve(self, arid: str, prompt: list[int], params: dict[str, Any], prefer_node: str | None,
                       excluded: set[str]) -> tuple[Worker, int]:
        ranked = rank_decode(self.pool.views("decode"), prefer_node=prefer_node, exclude=excluded)
        no_transfer = 0
        for view in ranked:
            w = self.pool.get("decode", view.url)
            w.in_flight += 1  # counted from now, so concurrent picks see it; the caller keeps it on success
            ok = False
            try:
                r = await self.client.post(f"{w.url}/internal/reserve",
                                           json={"request_id": arid, "prompt_token_ids": prompt, "params": params})
                ok = r.status_code == 200
            except httpx.TransportError as e:
                self.pool.mark_failed("decode", w.url, str(e))
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
                return w, int(r.json()["transfer_port"])
            if r.status_code == 400:
                raise await _error_of(r)
            if r.status_code == 503 and (await _error_of(r)).body.get("error", {}).get("code") == "no_transfer":
                no_transfer += 1
            elif r.status_code >= 500 and r.status_code != 503:
                self.pool.mark_failed("decode", w.url, f"reserve: HTTP {r.status_code}")
        if ranked and no_transfer == len(ranked):
            raise NoTransferPath()
        raise NoCapacity("no decode worker has free KV blocks")

    def _detach(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cancel(self, w: Worker, arid: str) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self.client.post(f"{w.url}/internal/cancel", json={"request_id": arid}, timeout=2.0)

    async def _disaggregated(self, arid: str, prompt: list[int], params: dict[str, Any],
                             excluded: set[str]) -> AsyncIterator[Chunk]:
        pv = pick_prefill(self.pool.views("prefill"), exclude=excluded)
        if pv is None:
            async for c in self._direct(arid, prompt, params, excluded):
                yield c
            return
        p = self.pool.get("prefill", pv.url)
        try:
            d, port = await self._reserve(arid, prompt, params, p.node, excluded)
        except NoTransferPath:
            async for c in self._direct(arid, prompt, params, excluded):
                yield c
            return
        decoding = False
        first: dict[str, Any] | None = None
        p.outstanding_prompt_tokens += len(prompt)
        p.in_flight += 1
        stage = self.stages.cursor("prefill")
        try:
            body = {"request_id": arid, "prompt_token_ids": prompt, "params": params,
                    "target": {"host": d.host, "port": port}}
            try:
                async with self.client.stream("POST", f"{p.url}/internal/prefill", json=body) as resp:
                    if resp.status_code != 200:
                        err = await _error_of(resp)
                        if err.body.get("error", {}).get("code") == "no_transfer":  # misconfigured: skip it
                            raise WorkerFailed("prefill", p.url, "no KV transfer secret configured")
                        if resp.status_code in (429, 503):
                            raise NoCapacity(str(err))
                        if resp.status_code < 500:
                            raise err
                        raise WorkerFailed("prefill", p.url, f"HTTP {resp.status_code}")
                    async for ev in _lines(resp):
                        if ev.get("event") == "first_token":
                            first = ev
                            p.outstanding_prompt_tokens -= len(prompt)
                            stage.move("transfer")
                            yield Chunk([ev["token_id"]], ev.get("text", ""), bool(ev.get("finished")),
                                        ev.get("finish_reason"))
                            if ev.get("finished"):
                                return
                        elif ev.get("event") == "transferred":
                            transferred = True
                        elif ev.get("event") == "error":
                            if ev.get("stage") == "prefill":
                                raise WorkerFailed("prefill", p.url, f"prefill: {ev.get('message')}")
                            # The transfer broke: the decode side is the usual suspect (died, timed out).
                            raise WorkerFailed("decode", d.url, f"kv transfer: {ev.get('message')}")
                    # Read to the end (not break) so the worker's stream finishes normally and releases
                    # its blocks without relying on disconnect handling.
                    if not transferred:
                        raise WorkerFailed("prefill", p.url, "prefill stream ended early")
            except httpx.TransportError as e:
                self.pool.mark_failed("prefill", p.url, str(e))
                raise WorkerFailed("prefill", p.url, str(e)) from e
            assert first is not None
            stage.move("decode")
            decoding = True
            async for c in self._decode_stream(d, "/internal/decode",
                                               {"request_id": arid, "first_token_id": first["token_id"]}):
                yield c
        finally:
            stage.move(None)
            if first is None:
                p.outstanding_prompt_tokens -= len(prompt)
            p.in_flight -= 1
            d.in_flight -= 1
            if not decoding:  # the reservation was never consumed: give the blocks back now
                self._detach(self._cancel(d, arid))

    # ------------------------------------------------------------------ one attempt, decode worker only
    async def _direct(self, arid: str, prompt: list[int], params: dict[str, Any],
                      excluded: set[str]) -> AsyncIterator[Chunk]:
        ranked = rank_decode(self.pool.views("decode"), exclude=excluded)
        if not ranked:
            raise NoCapacity("no healthy decode worker")
        body = {"request_id": arid, "prompt_token_ids": prompt, "params": params}
        for view in ranked:
            w = self.pool.get("decode", view.url)
            w.in_flight += 1
            try:
                with self.stages.enter("decode"):
                    async for c in self._decode_stream(w, "/internal/generate", body):
                        yield c
                return
            except NoCapacity:
                continue
            finally:
                w.in_flight -= 1
        raise NoCapacity("every decode worker is full")

    async def _decode_stream(self, w: Worker, path: str, body: dict[str, Any]) -> AsyncIterator[Chunk]:
        try:
            async with self.client.stream("POST", f"{w.url}{path}", json=body) as resp:
                if resp.status_code != 200:
                    err = await _error_of(resp)
                    if resp.status_code in (429, 503):
                        raise NoCapacity(str(err))
                    if resp.status_code == 409:  # reservation expired: redo the whole pair
                        raise WorkerFailed("decode", w.url, "reservation expired")
                    if resp.status_code < 500:
                        raise err
                    raise WorkerFailed("decode", w.url, f"HTTP {resp.status_code}")
                async for ev in _lines(resp):
                    if ev.get("finish_reason") == "error" or (ev.get("error") and ev.get("finished")):
                        raise WorkerFailed("decode", w.url, str(ev.get("error")))
                    if ev.get("finish_reason") == "abort":
                        raise WorkerFailed("decode", w.url, "request aborted by the worker")
                    yield Chunk(list(ev.get("token_ids") or []), ev.get("text") or "", bool(ev.get("finished")),
                                ev.get("finish_reason"))
                    if ev.get("finished"):
                        return
        except httpx.TransportError as e:
            self.pool.mark_failed("decode", w.url, str(e))
            raise WorkerFailed("decode", w.url, str(e)) from e
        raise WorkerFailed("decode", w.url, "stream ended without a final chunk")


def params_dict(params: Any) -> dict[str, Any]:
    return dataclasses.asdict(params) if dataclasses.is_dataclass(params) else dict(params)  # type: ignore[arg-type]
