"""The OpenAI-compatible HTTP server of one worker.

`build_app(engine, ...)` returns a FastAPI app with /v1/completions, /v1/chat/completions,
/v1/models, /health, /metrics, /drain and /undrain. The request lifecycle (admission, deadline, abort on
disconnect, metrics) lives in serving.WorkerServer, reachable from any route as
`request.app.state.worker`, so extra routers passed in `routers=` (e.g. the prefill->decode
KV transfer endpoints) reuse it instead of re-implementing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from pdcluster import __version__
from pdcluster.worker.api import errors, limits, tracing
from pdcluster.worker.api.body import BODY_TIMEOUT_S, MAX_BODY_BYTES, parse_body
from pdcluster.worker.api.client_gone import unless_client_leaves
from pdcluster.worker.api.limits import ModelLimits
from pdcluster.worker.api.metrics import CONTENT_TYPE, WorkerMetrics
from pdcluster.worker.api.prompting import encode_text, render_chat
from pdcluster.worker.api.protocol import ChatCompletionRequest, CompletionRequest
from pdcluster.worker.api.responses import ModelCard, ModelList
from pdcluster.worker.api.shaping import ChoiceResult, Shaper, merge, sse_response
from pdcluster.worker.api.tokenize_request import DetokenizeRequest, TokenizeRequest
from pdcluster.worker.engine.outputs import RequestOutput
from pdcluster.worker.server.lifecycle import EngineLike, WorkerServer, find_attr
from pdcluster.worker.transfer.secret import check_internal_auth

log = logging.getLogger(__name__)



def build_app(
    engine: EngineLike,
    *,
    role: str = "both",
    served_model_name: str = "pdcluster",
    model_aliases: Sequence[str] = (),
    max_queue_depth: int | None = None,
    request_timeout: float | None = None,
    tokenizer: Any = None,
    metrics: WorkerMetrics | None = None,
    cluster: str | None = None,
    limits: ModelLimits | None = None,
    routers: Sequence[APIRouter] = (),
    on_startup: Sequence[Callable[[], Awaitable[None]]] = (),
    on_shutdown: Sequence[Callable[[], Awaitable[None]]] = (),
    internal_secret: bytes | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    body_timeout: float = BODY_TIMEOUT_S,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """The worker app. `tokenizer` defaults to the engine's (None = token-id prompts only).

    Requests naming a model other than `served_model_name` or one of `model_aliases` get 404
    (OpenAI's model_not_found); requests naming none are served.

    `on_startup` hooks run before /health turns ready (e.g. engine warm-up); `on_shutdown`
    hooks run after the server stops taking connections.

    `internal_secret` (the KV secret) guards /drain and /undrain with the same derived bearer token as
    /internal/*: anyone who can reach the port must not be able to take a worker out of rotation.
    """
    metrics = metrics or WorkerMetrics(role, cluster=cluster, model_name=served_model_name)
    metrics.build_info(package_version(), {"role": role, "served_model_name": served_model_name,
                                           **engine_settings(engine)})
    worker = WorkerServer(
        engine,
        role=role,
        served_model_name=served_model_name,
        metrics=metrics,
        max_queue_depth=max_queue_depth,
        request_timeout=request_timeout,
        tokenizer=tokenizer,
        limits=limits,
        model_aliases=model_aliases,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for hook in on_startup:
            await hook()
        worker.ready = True
        try:
            yield
        finally:
            worker.ready = False
            for hook in on_shutdown:
                await hook()

    app = FastAPI(title="pdcluster worker", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.worker = worker
    app.state.max_body_bytes, app.state.body_timeout = max_body_bytes, body_timeout  # read by api.body
    app.state.internal_secret = internal_secret
    app.state.tool_call_parser = tool_call_parser  # tool_choice "auto" (api/tool_calls.py)

    def count_invalid(status: int) -> None:
        if status == 400:
            metrics.rejected("invalid")

    errors.install_error_handlers(app, on_error=count_invalid)
    tracing.install(app)  # a span per POST when tracing is configured (api/tracing.py)
    app.include_router(_openai_routes())
    app.include_router(_ops_routes())
    for r in routers:
        app.include_router(r)
    return app


def package_version() -> str:
    try:
        return importlib.metadata.version("pdcluster")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def engine_settings(engine: Any) -> dict[str, Any]:
    """The engine's scalar settings (block size, batch limits, ...) for pdcluster_build_info, when it has a
    dataclass config; a fake engine in tests has none."""
    config = find_attr(engine, "config")
    if config is None or not dataclasses.is_dataclass(config) or isinstance(config, type):
        return {}  # asdict needs an instance: a dataclass *class* has no settings to report
    return {k: v for k, v in dataclasses.asdict(config).items() if isinstance(v, int | float | str | bool)}


def _worker(request: Request) -> WorkerServer:
    return request.app.state.worker  # type: ignore[no-any-return]


async def _collect(request: Request, outputs: AsyncIterator[tuple[int, RequestOutput]]
                   ) -> list[tuple[int, RequestOutput]]:
    """Gather a non-streaming result, aborting the request if the client disconnects meanwhile."""

    async def gather() -> list[tuple[int, RequestOutput]]:
        async with contextlib.aclosing(outputs) as outs:  # type: ignore[type-var]
            return [o async for o in outs]

    return await unless_client_leaves(request, gather())  # cancelling closes `outputs`: the engine aborts


def _check_final(out: RequestOutput | None) -> None:
    if out is None or not out.finished:
        raise errors.APIError(500, "the engine ended the request without a final output", code="engine_error")
    if out.finish_reason == "error":
        raise errors.engine_failure(out.error)
    if out.finish_reason == "abort":
        raise errors.APIError(503, "the request was aborted by the worker", code="aborted")


async def _visible(outputs: AsyncIterator[RequestOutput], want_ids: bool, counted: list[int] | None = None
                   ) -> AsyncIterator[RequestOutput]:
    """The outputs worth a stream chunk; a failed or aborted end raises (it becomes an error event). `counted`
    adds up every output's tokens, shown or not (usage counts tokens, not chunks)."""
    async for out in outputs:
        if counted is not None:
            counted[0] += len(out.new_token_ids)
        if out.finished and out.finish_reason in ("error", "abort"):
            _check_final(out)
        if out.new_text or out.finished or (want_ids and out.new_token_ids):
            yield out


@dataclass
class _Joined:
    result: ChoiceResult
    completion_tokens: int


def _joined(index: int, outs: list[RequestOutput]) -> _Joined:
    """A whole non-streamed choice: its text, token ids, logprobs and finish reason."""
    final = outs[-1] if outs else None
    _check_final(final)
    assert final is not None
    ids = [t for o in outs for t in o.new_token_ids]
    lps = [e for o in outs for e in o.logprobs or []] if any(o.logprobs for o in outs) else None
    text = "".join(o.new_text for o in outs)
    return _Joined(ChoiceResult(index, text, ids, final.finish_reason, lps), final.completion_tokens)


def _openai_routes() -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models")
    async def models(request: Request) -> ModelList:
        w = _worker(request)
        return ModelList(
            data=[ModelCard(id=w.served_model_name, root=w.served_model_name, max_model_len=w.limits.max_model_len)]
        )

    @r.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> ModelCard:
        w = _worker(request)
        w.check_model(model_id or "?")
        return ModelCard(id=model_id, root=w.served_model_name, max_model_len=w.limits.max_model_len)

    @r.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @r.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        w = _worker(request)
        req = await parse_body(request, TokenizeRequest)
        w.check_model(req.model)
        if req.messages is not None:
            limits.check_prompt_chars(req.prompt_chars(), w.limits, "messages")  # before the template runs
            msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
            ids = await asyncio.to_thread(render_chat, w.tokenizer, msgs, req.add_generation_prompt,
                                          max_chars=limits.prompt_char_limit(w.limits))
        else:
            assert req.prompt is not None
            limits.check_prompt_chars(len(req.prompt), w.limits, "prompt")
            ids = await asyncio.to_thread(encode_text, w.tokenizer, req.prompt,
                                          add_special_tokens=req.add_special_tokens)
        return JSONResponse({"count": len(ids), "max_model_len": w.limits.max_model_len, "tokens": ids})

    @r.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        w = _worker(request)
        req = await parse_body(request, DetokenizeRequest)
        w.check_model(req.model)
        vocab = w.limits.vocab_size
        if vocab is not None and any(not 0 <= t < vocab for t in req.tokens):
            raise errors.bad_request(f"tokens must be in [0, {vocab})", param="tokens", code="invalid_token_id")
        if w.tokenizer is None:
            raise errors.bad_request("this model has no tokenizer", code="no_tokenizer")
        return JSONResponse({"prompt": await asyncio.to_thread(w.tokenizer.decode, req.tokens)})

    async def handle(request: Request, model: type[CompletionRequest] | type[ChatCompletionRequest]) -> Response:
        arrival = time.monotonic()
        w = _worker(request)
        req = await parse_body(request, model)
        tools = req.tool_plan(request.app.state.tool_call_parser) if isinstance(req, ChatCompletionRequest) else None
        subs = await unless_client_leaves(request, w.prepare_all(req))
        w.admit(len(subs))  # each sequence takes its place in the queue
        n_prompt = sum(len(s.prompt_ids) for s in subs if s.index % req.num_choices() == 0)
        shape = Shaper("chat" if model is ChatCompletionRequest else "completions", w.served_model_name, n_prompt,
                       req.return_token_ids, include_usage=req.include_usage(),
                       logprobs=subs[0].params.logprobs is not None, tools=tools)
        streams = [w.run(shape.rid if len(subs) == 1 else f"{shape.rid}-{s.index}", s.prompt_ids, s.params, arrival,
                         span=tracing.span_of(request)) for s in subs]
        want = req.return_token_ids or shape.logprobs

        if req.stream:
            counted = [0]
            merged = merge([_visible(o, want, counted) for o in streams])

            async def events() -> AsyncIterator[str]:
                for opener in shape.opening(len(subs)):
                    yield opener
                for s in subs:
                    if s.echo:
                        yield shape.chunk(s.echo, [], None, s.index)
                async for i, out in merged:
                    piece = shape.chunk(out.new_text, out.new_token_ids, out.finish_reason if out.finished else None,
                                        subs[i].index, out.logprobs)
                    if piece:  # a tool-call parser may hold text back
                        yield piece
                for last in shape.usage_chunk(counted[0]):
                    yield last

            async def close_all() -> None:
                await merged.aclose()
                for o in streams:
                    await o.aclose()

            return sse_response(events(), close_all)

        results = await _collect(request, merge(streams))
        choices = [_joined(subs[i].index, [o for j, o in results if j == i]) for i in range(len(subs))]
        total = sum(c.completion_tokens for c in choices)
        return JSONResponse(shape.final([c.result for c in choices], total, [s.echo for s in subs]))

    @r.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await handle(request, CompletionRequest)

    @r.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        return await handle(request, ChatCompletionRequest)

    return r


async def _operator_auth(request: Request) -> None:
    """/drain and /undrain take the /internal/* bearer token (derived from the KV secret; none in local dev)."""
    if not check_internal_auth(request.app.state.internal_secret, request.headers.get("authorization")):
        raise errors.APIError(401, "missing or invalid internal authentication token", type="authentication_error",
                              code="invalid_internal_token", headers={"WWW-Authenticate": "Bearer"})


def _ops_routes() -> APIRouter:
    r = APIRouter()

    @r.get("/health")
    async def health(request: Request) -> JSONResponse:
        status, body = _worker(request).health()
        return JSONResponse(body, status_code=status)

    @r.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(_worker(request).metrics.render(), media_type=CONTENT_TYPE)

    @r.post("/drain", dependencies=[Depends(_operator_auth)])
    async def drain(request: Request, wait: bool = False, timeout: float | None = None) -> JSONResponse:
        """Stop taking new work; with ?wait=true return only when in-flight requests are done (a prefill's
        include the KV it still sends). ``in_flight_at_drain``: what was in flight when the drain arrived."""
        w = _worker(request)
        at_drain = w.in_flight
        idle = await w.drain(wait=wait, timeout=timeout)
        return JSONResponse({"status": "draining", "in_flight": w.in_flight, "idle": idle,
                             "in_flight_at_drain": at_drain})

    @r.post("/undrain", dependencies=[Depends(_operator_auth)])
    async def undrain(request: Request) -> JSONResponse:
        """Take new work again (a drain whose scale-down was called off, or one sent by mistake)."""
        w = _worker(request)
        w.draining = False
        return JSONResponse({"status": "ok" if w.ready else "starting", "in_flight": w.in_flight})

    return r
