"""The router's HTTP face: the same OpenAI API as a worker (streaming included), plus /cluster, /health and
/metrics. Requests are tokenized on a worker, then handed to `Flow`, which picks workers and survives
worker failures; this module only does admission, deadlines, metrics, and OpenAI formatting."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pdcluster import __version__
from pdcluster.worker.api import errors, tracing
from pdcluster.worker.api.api_key import install as install_api_key
from pdcluster.worker.api.body import MAX_BODY_BYTES, json_object
from pdcluster.worker.api.client_gone import unless_client_leaves
from pdcluster.worker.api.metrics import CONTENT_TYPE, WorkerMetrics
from pdcluster.worker.api.responses import new_id
from pdcluster.worker.api.shaping import ChoiceResult, Shaper, merge, sse_response
from pdcluster.worker.api.tool_calls import ToolPlan
from pdcluster.worker.router.aggregate import Placements
from pdcluster.worker.router.flow import Chunk, Flow, Tokenized
from pdcluster.worker.router.front_door import credentials, sequences, use_api_key
from pdcluster.worker.router.options import RouterOptions
from pdcluster.worker.router.picking import admit, retry_after_seconds
from pdcluster.worker.router.pool import Pool
from pdcluster.worker.router.upstream import NoCapacity, UpstreamError

log = logging.getLogger(__name__)


class _StageCollector(Collector):
    """pdcluster_router_requests_in_stage{stage} read at scrape time: queued, prefill, transfer, decode."""

    def __init__(self, state: RouterState) -> None:
        self.state = state

    def collect(self) -> Any:
        g = GaugeMetricFamily("pdcluster_router_requests_in_stage",
                              "Requests at the router by stage (queued, prefill, transfer, decode).",
                              labels=["role", "stage"])
        for stage, n in self.state.flow.stages.counts.items():
            g.add_metric(["router", stage], n)
        yield g
        h = GaugeMetricFamily("pdcluster_router_workers", "Workers known to the router.",
                              labels=["role", "pool", "state"])
        for pool in ("prefill", "decode"):
            ws = self.state.pool.pool(pool)
            h.add_metric(["router", pool, "healthy"], sum(w.healthy for w in ws))
            h.add_metric(["router", pool, "unhealthy"], sum(not w.healthy for w in ws))
        yield h
        yield from placement_families(self.state.flow.placements)


def placement_families(placements: Placements) -> list[Any]:
    """pdcluster_router_placements_total{placement,reason}: where each attempt prefilled and why (router/
    aggregate.py); pdcluster_router_load_aggregation_engaged: 1 while the prefill queue misses --ttft-slo."""
    c = CounterMetricFamily("pdcluster_router_placements",
                            "Requests by where their prompt was prefilled (aggregated: on the decode worker; "
                            "disaggregated: on a prefill worker; prefill_only: whole on a prefill worker) and why.",
                            labels=["role", "placement", "reason"])
    for (placement, reason), n in sorted(placements.counts.items()):
        c.add_metric(["router", placement, reason], n)
    g = GaugeMetricFamily("pdcluster_router_load_aggregation_engaged",
                          "1 while the prefill queue's estimated wait misses the TTFT target and decode workers "
                          "with slack prefill long prompts themselves.", labels=["role"])
    g.add_metric(["router"], int(placements.engaged))
    return [c, g]


class RouterState:
    def __init__(self, pool: Pool, options: RouterOptions, *, cluster: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, tool_call_parser: str | None = None) -> None:
        self.pool = pool
        self.max_body_bytes = max_body_bytes
        # Calls to workers' public routes (/v1/models) go without the internal bearer token: it belongs to
        # authenticated /internal/* calls only (Flow's and Pool's clients).
        # A dead worker refuses at once (connect 2 s); a live one busy with a long step on shared cores may take
        # seconds to answer even a listing (2 s in all made /v1/models 503 under load on the CI box).
        self.public_client = httpx.AsyncClient(timeout=httpx.Timeout(10.0, connect=2.0))
        self.models_answer: dict[str, Any] | None = None  # the last /v1/models a worker gave (see models())
        self.flow = Flow(pool, options)
        self.flow.tool_call_parser = tool_call_parser
        # 0 on the command line: no bound
        self.max_queue_depth, self.request_timeout = options.max_queue_depth or None, options.request_timeout or None
        self.metrics = WorkerMetrics("router", cluster=cluster)
        self.metrics.bind_stats(self._stats)
        self.flow.metrics = self.metrics
        self.vllm: Any = None  # --engine vllm: the vLLM handshake (router/vllm_pd.py) instead of `flow`
        if pool.engine == "vllm":
            from pdcluster.worker.router.vllm_pd import VLLMFlow

            self.vllm = VLLMFlow(pool, threshold=options.disaggregation_threshold, max_retries=options.max_retries,
                                 decode_wait=options.decode_wait, placements=self.flow.placements)
        self.metrics.registry.register(_StageCollector(self))
        self.waiting = 0  # admitted, no first token yet: the router's queue
        self.in_flight = 0
        self._done: deque[float] = deque(maxlen=256)

    def _stats(self) -> dict[str, Any]:
        return {"waiting": self.waiting, "running": self.in_flight - self.waiting}

    def completion_rate(self) -> float:
        now = time.monotonic()
        recent = [t for t in self._done if now - t < 10.0]
        return len(recent) / 10.0

    def ready(self) -> bool:
        """Every request needs a decode worker (prefill workers only help): without one, not ready."""
        return any(w.healthy for w in self.pool.pool("decode"))

    def admit(self, cost: int = 1) -> None:
        """503 without workers, 429 when the queue has no room for `cost` more sequences (prompts x n)."""
        if not self.pool.any_healthy():
            self.metrics.rejected("not_ready")
            raise errors.unavailable("no healthy workers behind the router", code="no_workers")
        if not self.ready():
            # Answer at once (503 + Retry-After) instead of queueing behind a pool that may stay empty
            # (all decode workers down, restarting or drained).
            self.metrics.rejected("not_ready")
            raise errors.unavailable("no healthy decode worker behind the router (down, restarting or draining)",
                                     code="no_decode_worker")
        if self.max_queue_depth and cost > self.max_queue_depth:
            raise errors.bad_request(f"the request stands for {cost} sequences (prompts x n); the router queues "
                                     f"at most {self.max_queue_depth}", param="n", code="too_many_sequences")
        if not admit(self.waiting + cost - 1, self.max_queue_depth):
            self.metrics.rejected("queue_full")
            raise errors.queue_full(retry_after_seconds(self.waiting, self.completion_rate()))


def _state(request: Request) -> RouterState:
    return request.app.state.router  # type: ignore[no-any-return]


class Tracker:
    """TTFT/TPOT as the client sees them, plus the router's queue accounting, for one request."""

    def __init__(self, st: RouterState, arrival: float, cost: int = 1) -> None:
        self.st, self.arrival, self.last, self.cost = st, arrival, arrival, cost
        self.first, self.tokens, self.finished = True, 0, False
        st.waiting += cost  # a fan-out waits as the sequences it stands for
        st.in_flight += 1

    def saw(self, c: Chunk) -> None:
        n = len(c.token_ids)
        if not n:
            return
        now = time.monotonic()
        if self.first:
            self.first = False
            self.st.waiting -= self.cost
            self.st.metrics.observe_ttft(now - self.arrival)
            if n > 1:
                self.st.metrics.observe_tpot((now - self.last) / n)
        else:
            self.st.metrics.observe_tpot((now - self.last) / n)
        self.last = now
        self.tokens += n
        self.st.metrics.tokens_generated(n)

    def done(self) -> None:
        if self.finished:  # idempotent: called by the stream's finally and by its finalizer
            return
        self.finished = True
        if self.first:
            self.st.waiting -= self.cost
        self.st.in_flight -= 1
        self.st._done.append(time.monotonic())


async def _deadline_chunks(st: RouterState, rid: str, tok: Tokenized, tracker: Tracker) -> AsyncIterator[Chunk]:
    deadline = None if not st.request_timeout else tracker.arrival + st.request_timeout
    loop_deadline = None if deadline is None else asyncio.get_running_loop().time() + (deadline - time.monotonic())
    async with contextlib.aclosing(st.flow.run(rid, tok, tracker.arrival)) as chunks:  # type: ignore[type-var]
        while True:
            try:
                async with asyncio.timeout_at(loop_deadline):
                    c = await anext(chunks)
            except StopAsyncIteration:
                return
            except TimeoutError:
                st.metrics.rejected("timeout")
                raise errors.timeout(st.request_timeout or 0.0) from None
            tracker.saw(c)
            yield c


def _upstream(e: UpstreamError) -> errors.APIError:
    err = e.body.get("error", {}) if isinstance(e.body, dict) else {}
    return errors.APIError(e.status, str(err.get("message", e)), code=err.get("code"), param=err.get("param"))


def build_router_app(state: RouterState, api_key: str | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.pool.start()
        try:
            yield
        finally:
            await state.flow.close()
            if state.vllm is not None:
                await state.vllm.close()
            await state.public_client.aclose()
            await state.pool.stop()

    app = FastAPI(title="pdcluster router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = state
    app.state.max_body_bytes = state.max_body_bytes  # read by api.body
    errors.install_error_handlers(app, on_error=lambda s: state.metrics.rejected("invalid") if s == 400 else None)
    install_api_key(app, api_key)
    use_api_key(state.pool, state.flow, api_key)
    tracing.install(app)  # a span per POST when tracing is configured; the request's trace root

    async def handle(request: Request, kind: str) -> Response:
        st = _state(request)
        arrival = time.monotonic()
        body = await json_object(request)  # capped while reading; hostile JSON is a 400 here, not a 500 later
        cost = sequences(body)
        st.admit(cost)
        tracker = Tracker(st, arrival, cost)
        if st.vllm is not None:  # admitted here; the rest is router/vllm_pd.py's
            return await st.vllm.respond(st, kind, body, tracker)  # type: ignore[no-any-return]
        span = tracing.span_of(request)  # its traceparent goes on every /internal/* call made for this request
        try:
            try:  # a compile queued on the worker for a client that left is cancelled there too
                tok = await unless_client_leaves(request, st.flow.tokenize(kind, body, span))
            except UpstreamError as e:
                raise _upstream(e) from None
            except NoCapacity:
                raise errors.unavailable("no healthy worker could take the request", code="no_workers") from None
            st.metrics.request_accepted(len(tok.prompt_token_ids))
            rid = new_id("chatcmpl" if kind == "chat" else "cmpl")
            subs = tok.choices()
            span.set({"pdcluster.request_id": rid, "gen_ai.request.model": tok.model})
            for s in subs:
                s.trace = span
            chunks = merge([_deadline_chunks(st, rid if len(subs) == 1 else f"{rid}-{s.index}", s, tracker)
                            for s in subs])
            if tok.stream:
                resp = _stream(kind, rid, tok, chunks, tracker)
                tracker = None  # type: ignore[assignment]  # the stream owns it now
                return resp
            return await _collect(request, kind, rid, tok, chunks)
        finally:
            if tracker is not None:
                tracker.done()

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await handle(request, "completions")

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        return await handle(request, "chat")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        st = _state(request)
        healthy = [w for w in st.pool.workers.values() if w.healthy]
        for w in healthy:
            with contextlib.suppress(Exception):
                r = await st.public_client.get(f"{w.url}/v1/models", headers=credentials(request))
                if r.status_code == 200:
                    st.models_answer = r.json()
                    return JSONResponse(st.models_answer)
        if healthy and st.models_answer is not None:
            # healthy workers that could not answer a listing now (busy, restarting their HTTP side) still serve
            # the model they listed: what it is changes only with a rollout, which a worker then answers
            return JSONResponse(st.models_answer)
        raise errors.unavailable("no healthy workers behind the router", code="no_workers")

    async def to_worker(request: Request, method: str, path: str, body: dict[str, Any] | None = None) -> Response:
        """A public, model-level route answered by any healthy worker (they all serve the same model)."""
        st = _state(request)
        for w in [w for w in st.pool.workers.values() if w.healthy]:
            try:
                r = await st.public_client.request(method, f"{w.url}{path}", json=body, headers=credentials(request))
            except httpx.HTTPError:
                continue
            if r.status_code < 500:
                return JSONResponse(r.json(), status_code=r.status_code)
        raise errors.unavailable("no healthy workers behind the router", code="no_workers")

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        return await to_worker(request, "GET", f"/v1/models/{quote(model_id, safe='')}")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await to_worker(request, "POST", "/tokenize", await json_object(request))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await to_worker(request, "POST", "/detokenize", await json_object(request))

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/cluster")
    async def cluster(request: Request) -> JSONResponse:
        st = _state(request)
        snap: dict[str, Any] = st.pool.snapshot()
        snap["router"] = {"waiting": st.waiting, "in_flight": st.in_flight, "stages": dict(st.flow.stages.counts),
                          "retries": st.flow.retries, "resumes": st.flow.resumes,
                          "pair_quarantines": st.flow.quarantine.quarantines,
                          "quarantined_pairs": [list(p) for p in st.flow.quarantine.active()],
                          "prefix_routing": st.pool.prefix_routing,
                          "prefix_routed_tokens": st.flow.prefix_routed_tokens,
                          "prefix_expected_tokens": st.flow.prefix_expected_tokens,
                          "disaggregation_threshold": st.flow.threshold, "max_queue_depth": st.max_queue_depth,
                          "ttft_slo": st.flow.ttft_slo, **st.flow.placements.describe()}
        if st.vllm is not None:  # --engine vllm: the handshake's own counts
            snap["router"].update(engine="vllm", vllm_disaggregated=st.vllm.disaggregated,
                                  retries=st.flow.retries + st.vllm.retries,
                                  resumes=st.flow.resumes + st.vllm.resumes)
        return JSONResponse(snap)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """Readiness: 503 while no decode worker is healthy (the router could only refuse requests)."""
        st = _state(request)
        ok = st.ready()
        status = "ok" if ok else ("no_decode_workers" if st.pool.any_healthy() else "no_workers")
        body = {"status": status, "role": "router",
                "healthy_workers": sum(w.healthy for w in st.pool.workers.values()),
                "healthy_decode_workers": sum(w.healthy for w in st.pool.pool("decode"))}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/live")
    async def live() -> JSONResponse:
        """Liveness: the router process answers (an empty decode pool is not a reason to restart it)."""
        return JSONResponse({"status": "ok", "role": "router"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)

    return app


async def _collect(request: Request, kind: str, rid: str, tok: Tokenized,
                   chunks: AsyncIterator[tuple[int, Chunk]]) -> JSONResponse:
    subs = tok.choices()
    got: list[list[Chunk]] = [[] for _ in subs]

    async def gather() -> None:
        async with contextlib.aclosing(chunks):  # type: ignore[type-var]
            async for i, c in chunks:
                got[i].append(c)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    # A client that gives up on a non-streaming request must not leave workers generating for nobody:
    # cancelling `work` closes the chunk stream, which closes the worker streams, which aborts there.
    work, watch = asyncio.ensure_future(gather()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise errors.APIError(499, "client disconnected", code="client_closed")
    try:
        work.result()
    except UpstreamError as e:
        raise _upstream(e) from None
    choices = []
    for s, cs in zip(subs, got, strict=True):
        ids = [t for c in cs for t in c.token_ids]
        reason = next((c.finish_reason for c in reversed(cs) if c.finished), None)
        lps = [e for c in cs for e in c.logprobs or []] if any(c.logprobs for c in cs) else None
        choices.append(ChoiceResult(s.index, "".join(c.text for c in cs), ids, reason, lps))
    total = sum(len(c.token_ids) for c in choices)
    return JSONResponse(_shaper(kind, rid, tok).final(choices, total, [s.echo for s in subs]))


def _shaper(kind: str, rid: str, tok: Tokenized) -> Shaper:
    n_prompt = sum(len(s.prompt_token_ids) for s in tok.choices() if s.index % max(tok.n, 1) == 0)
    return Shaper("chat" if kind == "chat" else "completions", tok.model, n_prompt, tok.return_token_ids, rid=rid,
                  include_usage=tok.include_usage, logprobs=tok.params.get("logprobs") is not None,
                  tools=ToolPlan.from_dict(tok.tools))


def _stream(kind: str, rid: str, tok: Tokenized, chunks: AsyncIterator[tuple[int, Chunk]],
            tracker: Tracker) -> StreamingResponse:
    shape = _shaper(kind, rid, tok)
    subs = tok.choices()

    async def events() -> AsyncIterator[str]:
        total = 0
        for opener in shape.opening(len(subs)):
            yield opener
        for s in subs:
            if s.echo:
                yield shape.chunk(s.echo, [], None, s.index)
        async for i, c in chunks:
            total += len(c.token_ids)
            if shape.worth_a_chunk(c.text, c.token_ids, c.finished):
                piece = shape.chunk(c.text, c.token_ids, c.finish_reason if c.finished else None, subs[i].index,
                                    c.logprobs)
                if piece:  # a tool-call parser may hold text back
                    yield piece
        for last in shape.usage_chunk(total):
            yield last

    async def cleanup() -> None:
        try:
            await chunks.aclose()  # type: ignore[attr-defined]
        finally:
            tracker.done()

    resp = sse_response(events(), cleanup, lambda e: _upstream(e) if isinstance(e, UpstreamError) else None)
    # If the client vanishes before Starlette starts iterating, `cleanup` never runs; the finalizer still
    # returns the request's place in the queue (else a few early disconnects would fill it for good).
    weakref.finalize(resp.body_iterator, tracker.done)
    return resp
