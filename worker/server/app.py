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
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from pdcluster.worker.api import errors
from pdcluster.worker.api.metrics import CONTENT_TYPE, WorkerMetrics
from pdcluster.worker.engine.outputs import RequestOutput
from pdcluster.worker.api.prompting import encode_prompt, render_chat
from pdcluster.worker.api.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
    new_id,
)
from pdcluster.worker.server.lifecycle import EngineLike, ModelLimits, WorkerServer
from pdcluster.worker.transfer.secret import check_internal_auth

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024  # far above any real prompt; stops a runaway client early
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
M = TypeVar("M", bound=BaseModel)


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
) -> FastAPI:
    """The worker app. `tokenizer` defaults to the engine's (None = token-id prompts only).

    Requests naming a model other than `served_model_name` or one of `model_aliases` get 404
    (OpenAI's model_not_found); requests naming none are served.

    `on_startup` hooks run before /health turns ready (e.g. engine warm-up); `on_shutdown`
    hooks run after the server stops taking connections.

    `internal_secret` (the KV secret) guards /drain and /undrain with the same derived bearer token as
    /internal/*: anyone who can reach the port must not be able to take a worker out of rotation.
    """
    metrics = metrics or WorkerMetrics(role, cluster=cluster)
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
    app.state.internal_secret = internal_secret

    def count_invalid(status: int) -> None:
        if status == 400:
            metrics.rejected("invalid")

    errors.install_error_handlers(app, on_error=count_invalid)
    app.include_router(_openai_routes())
    app.include_router(_ops_routes())
    for r in routers:
        app.include_router(r)
    return app


def _worker(request: Request) -> WorkerServer:
    return request.app.state.worker  # type: ignore[no-any-return]


async def parse_body(request: Request, model: type[M]) -> M:
    """Parse and validate a JSON body ourselves so every failure is a 400 with a clear message."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():  # read incrementally so a huge body is refused early
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise errors.APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="body_too_large")
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body.strip():
        raise errors.bad_request("request body is empty; expected a JSON object")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise errors.bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise errors.bad_request("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, param = errors.format_validation_error(e)
        raise errors.bad_request(message, param=param) from None


def _sse(data: dict[str, Any] | BaseModel) -> str:
    payload = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    return f"data: {payload}\n\n"


async def _until_disconnected(request: Request) -> None:
    # After the body is read, the next ASGI message is http.disconnect when the client leaves.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(request: Request, outputs: AsyncGenerator[RequestOutput, None]) -> list[RequestOutput]:
    """Gather a non-streaming result, aborting the request if the client disconnects meanwhile."""

    async def gather() -> list[RequestOutput]:
        async with contextlib.aclosing(outputs) as outs:
            return [o async for o in outs]

    work = asyncio.ensure_future(gather())
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()  # closes `outputs`, whose cleanup aborts the engine request
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise errors.APIError(499, "client disconnected", code="client_closed")
    return work.result()


def _check_final(out: RequestOutput | None) -> None:
    if out is None or not out.finished:
        raise errors.APIError(500, "the engine ended the request without a final output", code="engine_error")
    if out.finish_reason == "error":
        raise errors.APIError(500, f"generation failed: {out.error or 'unknown error'}", code="engine_error")
    if out.finish_reason == "abort":
        raise errors.APIError(503, "the request was aborted by the worker", code="aborted")


async def _visible(outputs: AsyncIterator[RequestOutput], want_ids: bool) -> AsyncIterator[RequestOutput]:
    """The outputs worth a stream chunk; a failed or aborted end raises (it becomes an error event)."""
    async for out in outputs:
        if out.finished and out.finish_reason in ("error", "abort"):
            _check_final(out)
        if out.new_text or out.finished or (want_ids and out.new_token_ids):
            yield out


def _joined(outs: list[RequestOutput], want_ids: bool) -> tuple[str, list[int] | None, RequestOutput]:
    """A whole non-streamed result: its text, its token ids (when asked for) and the final output."""
    final = outs[-1] if outs else None
    _check_final(final)
    assert final is not None
    ids = [t for o in outs for t in o.new_token_ids] if want_ids else None
    return "".join(o.new_text for o in outs), ids, final


async def _prepare(
    worker: WorkerServer, req: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int], max_tokens: int | None
) -> tuple[list[int], Any]:
    limit = worker.check_prompt(prompt_ids, max_tokens)
    try:
        params = req.to_sampling_params(limit)
    except ValueError as e:
        raise errors.bad_request(str(e)) from None
    vocab = worker.limits.vocab_size
    if vocab is not None and any(not 0 <= t < vocab for t in params.stop_token_ids):
        raise errors.bad_request(f"stop_token_ids must be in [0, {vocab})", param="stop_token_ids")
    worker.check_request(prompt_ids, params)
    return prompt_ids, params


def _openai_routes() -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models")
    async def models(request: Request) -> ModelList:
        w = _worker(request)
        return ModelList(
            data=[ModelCard(id=w.served_model_name, root=w.served_model_name, max_model_len=w.limits.max_model_len)]
        )

    @r.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        w = _worker(request)
        req = await parse_body(request, CompletionRequest)
        w.check_model(req.model)
        prompt_ids = encode_prompt(w.tokenizer, req.prompt)
        prompt_ids, params = await _prepare(w, req, prompt_ids, req.max_tokens)
        w.admit()
        rid, model, created = new_id("cmpl"), w.served_model_name, int(time.time())
        outputs = w.run(rid, prompt_ids, params, arrival)
        n_prompt = len(prompt_ids)

        if req.stream:
            async def events() -> AsyncIterator[str]:
                async for out in _visible(outputs, req.return_token_ids):
                    choice = CompletionChoice(
                        text=out.new_text,
                        finish_reason=out.finish_reason if out.finished else None,
                        token_ids=list(out.new_token_ids) if req.return_token_ids else None,
                    )
                    usage = Usage.of(n_prompt, out.completion_tokens) if out.finished else None
                    chunk = CompletionResponse(id=rid, model=model, created=created, choices=[choice], usage=usage)
                    yield _sse(chunk)

            return _stream(outputs, events())

        text, ids, final = _joined(await _collect(request, outputs), req.return_token_ids)
        choice = CompletionChoice(text=text, finish_reason=final.finish_reason, token_ids=ids)
        usage = Usage.of(n_prompt, final.completion_tokens)
        body = CompletionResponse(id=rid, model=model, created=created, choices=[choice], usage=usage)
        return JSONResponse(body.model_dump())

    @r.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        arrival = time.monotonic()
        w = _worker(request)
        req = await parse_body(request, ChatCompletionRequest)
        w.check_model(req.model)
        prompt_ids = render_chat(w.tokenizer, req.template_messages(), req.add_generation_prompt)
        prompt_ids, params = await _prepare(w, req, prompt_ids, req.requested_max_tokens())
        w.admit()
        rid, model, created = new_id("chatcmpl"), w.served_model_name, int(time.time())
        outputs = w.run(rid, prompt_ids, params, arrival)
        n_prompt = len(prompt_ids)

        if req.stream:
            async def events() -> AsyncIterator[str]:
                # OpenAI sends the role alone first; clients key off it.
                first = ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))
                yield _sse(ChatCompletionChunk(id=rid, model=model, created=created, choices=[first]))
                async for out in _visible(outputs, req.return_token_ids):
                    choice = ChatChunkChoice(
                        delta=ChatDelta(content=out.new_text) if out.new_text else ChatDelta(),
                        finish_reason=out.finish_reason if out.finished else None,
                        token_ids=list(out.new_token_ids) if req.return_token_ids else None,
                    )
                    usage = Usage.of(n_prompt, out.completion_tokens) if out.finished else None
                    chunk = ChatCompletionChunk(id=rid, model=model, created=created, choices=[choice], usage=usage)
                    yield _sse(chunk)

            return _stream(outputs, events())

        text, ids, final = _joined(await _collect(request, outputs), req.return_token_ids)
        choice = ChatChoice(message=ChatMessageOut(content=text), finish_reason=final.finish_reason, token_ids=ids)
        usage = Usage.of(n_prompt, final.completion_tokens)
        chat_body = ChatCompletionResponse(id=rid, model=model, created=created, choices=[choice], usage=usage)
        return JSONResponse(chat_body.model_dump())

    return r


def _stream(outputs: AsyncGenerator[RequestOutput, None], events: AsyncIterator[str]) -> StreamingResponse:
    """SSE body: the chunks, then an error event if something failed, then `data: [DONE]`.

    A client disconnect cancels this generator (Starlette watches for http.disconnect); closing
    `outputs` in `finally` then aborts the engine request and frees its KV blocks at once.
    """

    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in events:
                yield chunk
        except errors.APIError as e:
            yield _sse(e.body())
        except Exception as e:
            log.exception("stream failed")
            yield _sse(errors.APIError(500, f"internal error: {type(e).__name__}: {e}").body())
        finally:
            await outputs.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


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
        """Stop taking new work; with ?wait=true return only when in-flight requests are done."""
        w = _worker(request)
        idle = await w.drain(wait=wait, timeout=timeout)
        return JSONResponse({"status": "draining", "in_flight": w.in_flight, "idle": idle})

    @r.post("/undrain", dependencies=[Depends(_operator_auth)])
    async def undrain(request: Request) -> JSONResponse:
        """Take new work again (a drain whose scale-down was called off, or one sent by mistake)."""
        w = _worker(request)
        w.draining = False
        return JSONResponse({"status": "ok" if w.ready else "starting", "in_flight": w.in_flight})

    return r
