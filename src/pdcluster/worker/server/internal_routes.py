"""Worker-side endpoints of prefill/decode disaggregation (mounted by build_app via `routers=`).

The router drives one disaggregated request like this:
  1. POST /internal/tokenize on any worker: the OpenAI body -> prompt token ids + sampling params (the
     router has no model files, so the worker owning the tokenizer does this and validates the request).
  2. POST /internal/reserve on the decode worker: cache blocks for the prompt are allocated *before* any KV
     moves (429 when there is no room). Between TP layouts each rank's port comes back too (tp_direct.py).
  3. POST /internal/prefill on the prefill worker: a prefill-only request whose KV the connector ships layer
     by layer to the decode worker; NDJSON `first_token` as soon as prefill is done, then `transferred` once
     every layer is acknowledged (or `error`).
  4. POST /internal/decode on the decode worker: waits for all layers, commits the import and streams the
     remaining tokens as NDJSON. Short prompts and resumes use /internal/generate (prefill on the decode side).
Every path that does not end normally releases the request's blocks on both sides (abort, cancel, or the
reaper for reservations that never get their /internal/decode)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from pdcluster.worker.api import errors, tracing
from pdcluster.worker.api.body import json_object, validate
from pdcluster.worker.api.client_gone import unless_client_leaves
from pdcluster.worker.api.internal import (
    CancelBody,
    DecodeBody,
    GenerateBody,
    PrefillBody,
    ReserveBody,
    TokenizeBody,
)
from pdcluster.worker.api.protocol import ChatCompletionRequest, CompletionRequest
from pdcluster.worker.engine.sampling_params import SamplingParams
from pdcluster.worker.server import ucx_bind
from pdcluster.worker.server.lifecycle import WorkerServer, engine_fault, observe_prefill
from pdcluster.worker.server.tp_direct import DirectKV
from pdcluster.worker.transfer import backend as transfer_backend
from pdcluster.worker.transfer.channel import TransferError
from pdcluster.worker.transfer.connector import TCPConnector, TransferTarget
from pdcluster.worker.transfer.options import TransferOptions
from pdcluster.worker.transfer.secret import check_internal_auth, worker_secret

log = logging.getLogger(__name__)
NDJSON = "application/x-ndjson"
M = TypeVar("M", bound=BaseModel)


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj) + "\n").encode()


def _out_line(out: Any, ids: list[int], text: str, lps: Any) -> bytes:
    """An output as a stream line; a failure carries the status the router passes on (400: the request's fault)."""
    status = errors.engine_failure(out.error).status if out.finish_reason == "error" else None
    return _line({"token_ids": ids, "text": text, "finished": out.finished, "logprobs": lps,
                  "finish_reason": out.finish_reason, "error": out.error, "status": status})


class Disaggregation:
    """Owns the KV connector of one worker and the /internal/* routes."""

    def __init__(self, engine: Any, *, role: str, secret: bytes | None, options: TransferOptions,
                 listen_host: str = "127.0.0.1", node: str | None = None) -> None:
        self.engine = engine  # AsyncEngine
        self.role = role
        self.options = options  # the --kv-transfer-* flags (transfer/options.py), handed to every rank
        self.timeout = options.timeout_s
        self.listen_host, self.transfer_port = listen_host, options.port or 0
        self.node = node if node is not None else os.environ.get("NODE_NAME")
        # the secret also authenticates router -> worker /internal/* calls (derived bearer token)
        self.secret = secret
        self.connector: TCPConnector | None = None  # or its subclass NixlConnector (transfer/backend.py)
        self.backend = "none"
        if secret is not None:  # `auto`: nixl where it loads, else tcp, said in one log line
            ucx_bind.bind_to_host(listen_host)  # before any NIXL agent exists: UCX listens where the worker does
            eng = getattr(engine, "engine", None)  # destination: float layers land in the blocks; pools: NIXL's
            self.connector, choice = transfer_backend.build(
                options, secret, importer=self._import, destination=getattr(eng, "import_views", None),
                pools=getattr(eng, "transfer_pools", None))
            self.backend = choice.backend
        self._reaper: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self.saving: set[str] = set()  # prefill requests whose KV is not yet delivered (a role flip waits on them)
        self.router = self._routes()
        self.layout = engine.kv_layout
        self.num_layers, self.kv_heads, self.head_dim = self.layout.num_layers, self.layout.kv_heads, self.layout.head_dim
        self.direct = DirectKV(self, path=options.tp_path)  # each TP rank's own endpoint, or the relay

    @classmethod
    def from_options(cls, engine: Any, role: str, options: TransferOptions,
                     listen_host: str = "127.0.0.1") -> Disaggregation:
        """From the worker's flags. Without a secret there is no transfer listener at all (frames are never
        accepted unauthenticated): the worker still serves the OpenAI API and `/internal/generate`, and the
        router prefills on it directly. A given but unusable secret is an error."""
        return cls(engine, role=role, secret=worker_secret(options.secret_file, role), options=options,
                   listen_host=listen_host)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self.connector is not None:
            self.transfer_port = await self.connector.listen(self.listen_host, self.transfer_port)
            log.info("kv transfer listening on %s:%d", self.listen_host, self.transfer_port)
            await self.direct.start()  # the followers' endpoints, when this worker has any
        await self.engine.set_kv_connector(self.connector)  # the engine exports prefill-only requests' KV
        self._reaper = asyncio.ensure_future(self._reap())

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        if self.connector is not None:
            await self.connector.close()

    def _detach(self, coro: Any) -> None:
        """Run cleanup as its own task: a streaming response cancelled by a client disconnect runs its
        `finally` inside a cancelled scope, where any await would be cancelled again and the blocks leaked."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _import(self, rid: str, layer: int, k: Any, v: Any, **where: Any) -> None:
        await self.engine.import_kv_layer(rid, layer, k, v, **where)  # token_start, scales (codes)

    async def _cancel(self, rid: str) -> None:
        self.direct.cancel(rid)
        if self.connector is not None:
            self.connector.cancel_load(rid)
            if not await self.connector.settle(rid):  # NIXL: a READ may still land in the blocks
                log.error("kv transfer %s: a READ into its blocks never ended: the blocks stay reserved", rid)
                return
        await self.engine.cancel_import(rid)

    async def _reap(self) -> None:
        """Reservations whose /internal/decode never came (router died, prefill died before it could tell
        anyone) are cancelled after twice the transfer timeout, so their blocks come back."""
        while True:
            await asyncio.sleep(1.0)
            if self.connector is None:
                continue
            now = time.monotonic()
            for rid, started in self.connector.pending_loads():
                if now - started > 2 * self.timeout:
                    log.warning("kv transfer %s: reservation expired, freeing its blocks", rid)
                    with contextlib.suppress(Exception):
                        await self._cancel(rid)

    def load(self, worker: WorkerServer) -> dict[str, Any]:
        s = self.engine.stats()
        total = int(s.get("kv_cache_total_blocks", 0))
        used = int(s.get("kv_cache_used_blocks", 0))
        # "ready" is what the router's probe admits on: a failed engine (a dead tensor-parallel rank) answers
        # every request 503, and a router that still saw it ready kept retrying it as busy, never falling back
        fault = engine_fault(self.engine)
        return {
            "role": self.role, "node": self.node, "ready": worker.ready and not worker.draining and fault is None,
            **({"error": fault} if fault else {}),
            "free_blocks": total - used, "total_blocks": total, "used_blocks": used,
            "block_size": self.layout.block_size,
            "running": int(s.get("requests_running", 0)), "waiting": int(s.get("requests_waiting", 0)),
            # the router's load-driven aggregation (router/aggregate.py): prefill speed and batch bound
            "prefill_tokens_per_s": float(s.get("prefill_tokens_per_s", 0.0)),
            "max_batch_size": int(s.get("max_batch_size", 0)),
            "in_flight": worker.in_flight, "transfer_port": self.transfer_port if self.connector else None,
            "pending_loads": len(self.connector.pending_loads()) if self.connector else 0,
            "transfer_backend": self.backend, "transfer_integrity": self.options.integrity, **self.direct.describe(),
        }

    # ------------------------------------------------------------------ routes
    def _routes(self) -> APIRouter:
        me = self

        async def authenticate(request: Request) -> None:
            # Only the router may drive these endpoints: with a secret configured every call must carry
            # `Authorization: Bearer <HMAC(secret, "pdcluster-internal-v1")>`; without one (local dev) none.
            if not check_internal_auth(me.secret, request.headers.get("authorization")):
                raise errors.APIError(401, "missing or invalid internal authentication token",
                                      type="authentication_error", code="invalid_internal_token",
                                      headers={"WWW-Authenticate": "Bearer"})

        r = APIRouter(prefix="/internal", dependencies=[Depends(authenticate)])

        def worker(request: Request) -> WorkerServer:
            return request.app.state.worker  # type: ignore[no-any-return]

        async def body(request: Request, model: type[M]) -> M:
            # The same capped parser and strict validation as the public routes (api.body, api.internal).
            return validate(model, await json_object(request))

        async def checked(request: Request, w: WorkerServer, run: ReserveBody | PrefillBody | GenerateBody
                          ) -> tuple[list[int], SamplingParams]:
            """What the router sends is held to the public path's limits (WorkerServer.check_routed)."""
            ids, params = run.prompt_token_ids, run.params.to_sampling_params()
            await unless_client_leaves(request, w.check_routed(ids, params))
            return ids, params

        @r.get("/load")
        async def load(request: Request) -> JSONResponse:
            ranks = {"kv_ranks": await me.direct.rank_stats()} if request.query_params.get("ranks") else {}
            return JSONResponse({**me.load(worker(request)), **ranks})

        @r.post("/tokenize")
        async def tokenize(request: Request) -> JSONResponse:
            w, data = worker(request), await body(request, TokenizeBody)
            req: CompletionRequest | ChatCompletionRequest = (
                validate(ChatCompletionRequest, data.body) if data.kind == "chat" else validate(CompletionRequest, data.body))
            tools = req.tool_plan(data.tool_call_parser) if isinstance(req, ChatCompletionRequest) else None
            subs = await unless_client_leaves(request, w.prepare_all(req))  # the public routes' checks, once
            return JSONResponse({"prompt_token_ids": subs[0].prompt_ids, "params": dataclasses.asdict(subs[0].params),
                                 "model": w.served_model_name, "stream": req.stream,
                                 "return_token_ids": req.return_token_ids, "n": req.num_choices(),
                                 "include_usage": req.include_usage(),
                                 "tools": tools.as_dict() if tools is not None else None,
                                 "subs": [{"index": s.index, "prompt_token_ids": s.prompt_ids,
                                           "params": dataclasses.asdict(s.params), "echo": s.echo} for s in subs]})

        @r.post("/reserve")
        async def reserve(request: Request) -> JSONResponse:
            w, data = worker(request), await body(request, ReserveBody)
            ids, params = await checked(request, w, data)
            if me.connector is None:
                raise errors.unavailable("this worker has no KV transfer listener", code="no_transfer")
            w.admit()
            rid = data.request_id
            try:  # whole layers, or each rank's heads: a layout the KV heads do not allow holds nothing
                specs = me.direct.load_specs(rid, len(ids), data.prefill_tp)
                ok = await me.engine.reserve_for_import(rid, ids, params)
            except ValueError as e:
                raise errors.bad_request(str(e)) from None
            if not ok:
                w.metrics.rejected("queue_full")
                raise errors.APIError(429, "no free KV cache blocks for this prompt", code="no_kv_blocks",
                                      headers={"Retry-After": "1"})
            me.connector.start_load_kv(specs[0])
            try:  # every follower expects its heads before the router hears where to send them
                ports = await me.direct.expect(rid, specs, me.engine)
            except TransferError as e:
                await me._cancel(rid)
                raise errors.unavailable(f"tensor-parallel ranks not ready: {e}", code="rank_failed") from None
            return JSONResponse({"transfer_port": me.transfer_port, "node": me.node, **ports})

        @r.post("/cancel")
        async def cancel(request: Request) -> JSONResponse:
            rid = (await body(request, CancelBody)).request_id
            await me._cancel(rid)
            me.engine.abort(rid)
            return JSONResponse({"cancelled": rid})

        @r.post("/prefill")
        async def prefill(request: Request) -> StreamingResponse:
            w, data = worker(request), await body(request, PrefillBody)
            ids, params = await checked(request, w, data)  # a bad request is a 400 here, not a broken stream later
            if me.connector is None:
                raise errors.unavailable("this worker has no KV transfer path", code="no_transfer")
            me.direct.check_target(data.target.rank_ports)  # a layout this worker's heads cannot go to: 400
            w.admit()
            rid, target = data.request_id, TransferTarget(data.target.host, data.target.port)
            return StreamingResponse(w.tracked(me._prefill_stream(w, rid, ids, params, target, tracing.span_of(request),
                                                                  data.target.rank_ports)), media_type=NDJSON)

        @r.post("/decode")
        async def decode(request: Request) -> StreamingResponse:
            w, data = worker(request), await body(request, DecodeBody)
            rid, first = data.request_id, data.first_token_id
            if me.connector is None or rid not in dict(me.connector.pending_loads()):
                raise errors.APIError(409, f"no reservation for {rid} (expired or cancelled)", code="no_reservation")
            return StreamingResponse(w.tracked(me._decode_stream(w, rid, first, tracing.span_of(request))),
                                     media_type=NDJSON)

        @r.post("/generate")
        async def generate(request: Request) -> StreamingResponse:
            w, data = worker(request), await body(request, GenerateBody)
            ids, params = await checked(request, w, data)
            w.admit()
            rid = data.request_id
            return StreamingResponse(me._generate_stream(w, rid, ids, params, tracing.span_of(request)),
                                     media_type=NDJSON)

        from pdcluster.worker.server.role_flip import add_role_route

        add_role_route(r, me)  # POST /internal/role: a role flip (server/role_flip.py)
        return r

    # ------------------------------------------------------------------ streams
    async def _prefill_stream(self, w: WorkerServer, rid: str, ids: list[int], params: SamplingParams,
                              target: TransferTarget, span: tracing.Span = tracing.NO_SPAN,
                              rank_ports: list[int] | None = None) -> AsyncIterator[bytes]:
        assert self.connector is not None
        conn = self.connector
        span.set({"pdcluster.request_id": rid, "pdcluster.prompt_tokens": len(ids)})
        phases = tracing.observed(w.metrics, span)  # the metrics, plus phase spans when tracing is on
        t0 = time.monotonic()
        routes = self.direct.start_save(rid, target, rank_ports)  # None: whole layers to one endpoint
        w.metrics.request_accepted(len(ids))
        held, done = False, False
        self.saving.add(rid)
        try:
            first = None
            try:
                async with contextlib.aclosing(self.engine.generate(rid, ids, params, prefill_only=True)) as outs:
                    async for out in outs:
                        first = out
                        if out.finished:
                            break
            except ValueError as e:  # the engine refused the request (raced a limit check_prompt passed)
                yield _line({"event": "error", "stage": "prefill", "message": str(e)})
                return
            if first is None or not first.new_token_ids:
                reason = (first.error if first else None) or "prefill produced no token"
                yield _line({"event": "error", "stage": "prefill", "message": reason})
                return
            w.metrics.observe_ttft(time.monotonic() - t0)
            observe_prefill(phases, first, t0, time.monotonic())
            w.metrics.tokens_generated(1)
            held = bool(first.extra.get("kv_held"))
            yield _line({"event": "first_token", "token_id": first.new_token_ids[0], "text": first.new_text,
                         "logprobs": first.logprobs,
                         "finished": not held, "finish_reason": None if held else first.finish_reason,
                         "prefill_seconds": time.monotonic() - t0})
            if not held:
                return  # the first token ended the request: nothing to transfer
            t_first = time.monotonic()
            try:
                res = await conn.wait_for_save(rid)
                res = res if routes is None else await self.direct.wait_saved(rid, res)
            except TransferError as e:
                w.metrics.kv_transfer_failed()
                yield _line({"event": "error", "stage": "transfer", "message": str(e)})
                return
            phases.kv_transfer(res.bytes, res.seconds)
            done = True
            # tail = what layer-wise pipelining could not hide: transfer time left after prefill ended
            yield _line({"event": "transferred", "seconds": res.seconds, "bytes": res.bytes,
                         "tail_seconds": time.monotonic() - t_first})
        finally:
            self.saving.discard(rid)
            if not done:
                self._detach(conn.abort_save(rid))
            self.direct.forget_save(rid, abort=not done)
            self._detach(self.engine.release(rid))

    async def _decode_stream(self, w: WorkerServer, rid: str, first: int,
                             span: tracing.Span = tracing.NO_SPAN) -> AsyncIterator[bytes]:
        assert self.connector is not None
        committed, finished = False, False
        span.set({"pdcluster.request_id": rid})
        t0 = time.monotonic()
        try:
            try:
                await self.connector.wait_for_load(rid, timeout=self.timeout)
                peers = await self.direct.wait_loaded(rid, self.timeout) if self.direct.loading(rid) else 0
                span.phase("kv_wait", time.monotonic() - t0)  # the KV still in flight when decode was asked
            except (TransferError, TimeoutError) as e:
                w.metrics.kv_transfer_failed()
                yield _line({"error": f"kv load failed: {e}", "finished": True, "finish_reason": "error"})
                return
            t_loaded = time.monotonic()
            stream = self.engine.open_stream(rid)
            try:
                await self.engine.commit_import(rid, first)
            except BaseException:  # incl. cancellation: the commit may still have run on the engine thread
                stream.close()  # aborts the request if it exists, so its blocks come back either way
                raise
            committed = True
            own, seconds = self.connector.finish_load(rid)
            self.direct.received[0] += own
            w.metrics.kv_transfer(own + peers, seconds)
            skip_first, last = True, time.monotonic()
            t_decode = last
            try:
                async for out in stream:
                    ids, text = out.new_token_ids, out.new_text
                    lps = out.logprobs
                    if skip_first and ids:  # the router already sent the first token (from prefill)
                        skip_first, ids, text, lps = False, ids[1:], "", (lps or [])[1:] or None
                        w.metrics.decode_joined(time.monotonic() - t_loaded)  # the planner's t_join
                    elif ids:
                        now = time.monotonic()
                        w.metrics.observe_tpot((now - last) / len(ids))
                        w.metrics.tokens_generated(len(ids))
                        last = now
                    finished = out.finished
                    if finished:
                        span.phase("decode", time.monotonic() - t_decode)
                        tracing.observed(w.metrics, span).request_finished(out.finish_reason, out.prompt_tokens,
                                                                           out.completion_tokens)
                    if ids or text or finished:
                        yield _out_line(out, ids, text, lps)
                    if finished:
                        return
            finally:
                stream.close()  # aborts the engine request if we leave early (router gone)
        finally:
            if not committed:
                self._detach(self._cancel(rid))

    async def _generate_stream(self, w: WorkerServer, rid: str, ids: list[int], params: SamplingParams,
                               span: tracing.Span = tracing.NO_SPAN) -> AsyncIterator[bytes]:
        span.set({"pdcluster.request_id": rid, "pdcluster.prompt_tokens": len(ids)})
        try:
            async with contextlib.aclosing(w.run(rid, ids, params, span=span)) as outs:
                async for out in outs:
                    if out.new_token_ids or out.new_text or out.finished:
                        yield _out_line(out, out.new_token_ids, out.new_text, out.logprobs)
        except errors.APIError as e:
            yield _line({"error": e.message, "finished": True, "finish_reason": "error", "status": e.status})
