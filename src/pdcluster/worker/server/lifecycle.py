"""The request lifecycle of one worker, independent of HTTP routing.

`WorkerServer` owns admission (ready / draining / queue depth), the per-request deadline,
metrics, and the guarantee that a request which does not finish normally (client gone,
timeout, error) is aborted in the engine so its KV blocks are freed. Routes in server.py, and
later the prefill->decode transfer routes, call `admit()` then iterate `run()`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Protocol

from pdcluster.worker.api import errors, tracing
from pdcluster.worker.api import limits as request_limits
from pdcluster.worker.api.fanout import Sub, expand
from pdcluster.worker.api.grammar_jobs import JOBS, GrammarJobs
from pdcluster.worker.api.limits import ModelLimits
from pdcluster.worker.api.metrics import WorkerMetrics, engine_gauges
from pdcluster.worker.api.prompting import encode_prompt, render_chat
from pdcluster.worker.api.protocol import ChatCompletionRequest, CompletionRequest
from pdcluster.worker.engine.outputs import RequestOutput
from pdcluster.worker.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineLike(Protocol):
    """What the server needs from `AsyncEngine`."""

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> Any: ...

    def stats(self) -> Mapping[str, Any]: ...


def find_attr(engine: Any, name: str) -> Any:
    """`engine.name`, else the wrapped engine's (AsyncEngine keeps its LLMEngine in `.engine`)."""
    value = getattr(engine, name, None)
    if value is None:
        value = getattr(getattr(engine, "engine", None), name, None)
    return value


def engine_fault(engine: Any) -> str | None:
    """Why the engine can no longer run a step (e.g. a tensor-parallel rank died), else None."""
    fault = find_attr(engine, "fault")
    return fault if isinstance(fault, str) else None


def probe_limits(engine: Any) -> ModelLimits:
    """Find vocab size and context length on the engine without depending on its exact layout."""
    candidates = [engine]
    for attr in ("engine", "model_config", "config"):
        obj = getattr(engine, attr, None)
        if obj is not None:
            candidates.append(obj)
            for sub in ("model_config", "model"):
                inner = getattr(obj, sub, None)
                if inner is not None:
                    candidates.append(inner)

    def first(*names: str) -> int | None:
        for obj in candidates:
            for n in names:
                v = getattr(obj, n, None)
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    return v
        return None

    return ModelLimits(
        vocab_size=first("vocab_size"),
        max_model_len=first("max_model_len", "max_seq_len", "max_position_embeddings"),
    )


def observe_prefill(metrics: WorkerMetrics, out: RequestOutput, arrival: float, now: float) -> None:
    """A request's first token: split the time since `arrival` into prefill_queue (until the engine first
    gave it compute) and prefill_compute (its prefill steps), when the engine says when that was."""
    scheduled = out.extra.get("scheduled_at") if isinstance(out.extra, dict) else None
    if isinstance(scheduled, float) and arrival <= scheduled <= now:
        metrics.phase("prefill_queue", scheduled - arrival)
        metrics.phase("prefill_compute", now - scheduled)


class WorkerServer:
    def __init__(
        self,
        engine: EngineLike,
        *,
        role: str,
        served_model_name: str,
        metrics: WorkerMetrics,
        max_queue_depth: int | None = None,
        request_timeout: float | None = None,
        tokenizer: Any = None,
        limits: ModelLimits | None = None,
        model_aliases: Sequence[str] = (),
        validate: Callable[[list[int], SamplingParams], None] | None = None,
    ) -> None:
        self.engine = engine
        self.role = role
        self.served_model_name = served_model_name
        self.model_names = {served_model_name, *model_aliases}
        self.metrics = metrics
        self.max_queue_depth = max_queue_depth if max_queue_depth and max_queue_depth > 0 else None
        self.request_timeout = request_timeout if request_timeout and request_timeout > 0 else None
        self.tokenizer = tokenizer if tokenizer is not None else find_attr(engine, "tokenizer")
        self.limits = limits or probe_limits(engine)
        # The engine's own request check (e.g. "needs more KV than the whole cache"), run before a
        # stream starts so such requests get a 400 instead of an error event after a 200.
        self.validate = validate if validate is not None else find_attr(engine, "validate_request")
        self.ready = False
        self.draining = False
        self.in_flight = 0  # admitted and not yet done
        self.pending = 0  # admitted, no token produced yet (queued or prefilling)
        self._idle = asyncio.Event()
        self._idle.set()
        self._background: set[asyncio.Future[Any]] = set()  # detached aborts, kept alive until done
        self.grammar_jobs: GrammarJobs = JOBS  # where structured-output grammars compile (api/grammar_jobs.py)
        metrics.bind_stats(self.engine_stats)

    # ------------------------------------------------------------------ state
    def engine_stats(self) -> Mapping[str, Any]:
        return self.engine.stats()

    def health(self) -> tuple[int, dict[str, Any]]:
        fault = engine_fault(self.engine)
        status = "failed" if fault else "draining" if self.draining else ("ok" if self.ready else "starting")
        body = {"status": status, "role": self.role, "model": self.served_model_name, "in_flight": self.in_flight}
        if fault:
            body["error"] = str(fault)
        return (200 if status == "ok" else 503), body

    async def drain(self, wait: bool = False, timeout: float | None = None) -> bool:
        """Refuse new work from now on; optionally wait until in-flight requests are done."""
        self.draining = True
        if not wait:
            return self.in_flight == 0
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def check_model(self, name: str | None) -> None:
        if name and name not in self.model_names:
            shown = repr(name[:80]) + ("..." if len(name) > 80 else "")  # never echo a huge value whole
            raise errors.APIError(
                404, f"model {shown} is not served here (serving {self.served_model_name!r})",
                code="model_not_found", param="model",
            )

    # ------------------------------------------------------------------ admission
    def admit(self, cost: int = 1) -> None:
        """Raise the right 503/429 before any work is queued; counts the rejection. `cost`: the engine
        sequences the request stands for (prompts x n), each of which takes a place in the queue."""
        if self.draining:
            self.metrics.rejected("draining")
            raise errors.unavailable("worker is draining and accepts no new requests", code="draining")
        fault = engine_fault(self.engine)
        if not self.ready or fault:
            self.metrics.rejected("not_ready")
            raise errors.unavailable(f"worker failed: {fault}" if fault else "worker is not ready yet")
        if self.max_queue_depth is not None and cost > self.max_queue_depth:
            raise errors.bad_request(f"the request stands for {cost} sequences (prompts x n); this worker queues "
                                     f"at most {self.max_queue_depth}", param="n", code="too_many_sequences")
        if self.max_queue_depth is not None and self._waiting() + cost > self.max_queue_depth:
            self.metrics.rejected("queue_full")
            raise errors.queue_full()

    def _waiting(self) -> int:
        # Our own count sees requests the engine has not picked up yet; the engine's count also
        # sees requests preempted back into its queue. The larger one is the truth.
        engine_waiting = 0
        try:
            engine_waiting = int(engine_gauges(self.engine.stats())["waiting"])
        except Exception:
            log.exception("engine.stats() failed during admission")
        return max(self.pending, engine_waiting)

    async def prepare(self, req: CompletionRequest | ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
        """Model, prompt size, tokens and every limit of a validated OpenAI request, checked once (the public
        routes and /internal/tokenize both come here). The prompt is capped in characters before it is
        tokenized, and tokenized on a thread: a long prompt must not stall /health and every other stream."""
        self.check_model(req.model)
        if isinstance(req, ChatCompletionRequest):
            # messages, tools and template kwargs are counted before the template runs, its output before the
            # tokenizer does
            request_limits.check_prompt_chars(req.prompt_chars(), self.limits, "messages")
            ids = await asyncio.to_thread(render_chat, self.tokenizer, req.template_messages(),
                                          req.add_generation_prompt, **req.template_extras(),
                                          max_chars=request_limits.prompt_char_limit(self.limits))
            max_tokens = req.requested_max_tokens()
        else:
            request_limits.check_prompt_chars(req.prompt_chars(), self.limits, "prompt")
            prompt = req.prompts()[0]
            ids = (await asyncio.to_thread(encode_prompt, self.tokenizer, prompt) if isinstance(prompt, str)
                   else list(prompt))
            max_tokens = req.max_tokens
        params = request_limits.checked_params(req, ids, max_tokens, self.limits, self.validate)
        await self.check_grammar(req, params)
        return ids, params

    async def check_grammar(self, req: CompletionRequest | ChatCompletionRequest | None,
                            params: SamplingParams) -> None:
        """The request's grammar compiles, on the grammar pool within its budget (a no-op without one). `req`
        None: params that came over /internal/* (the router's tokenize already checked them elsewhere)."""
        await request_limits.check_grammar(req, params, find_attr(self.engine, "compile_grammar"), self.grammar_jobs)

    async def prepare_all(self, req: CompletionRequest | ChatCompletionRequest) -> list[Sub]:
        """Every engine request an OpenAI request stands for (each prompt of a batch, times n), each checked
        like `prepare` checks one (see api.fanout)."""
        if isinstance(req, ChatCompletionRequest):
            ids, params = await self.prepare(req)
            return expand([(ids, params, "")], req.num_choices())
        self.check_model(req.model)
        request_limits.check_prompt_chars(req.prompt_chars(), self.limits, "prompt")
        prompts = []
        for i, prompt in enumerate(req.prompts()):
            ids = (await asyncio.to_thread(encode_prompt, self.tokenizer, prompt) if isinstance(prompt, str)
                   else list(prompt))
            params = request_limits.checked_params(req, ids, req.max_tokens, self.limits, self.validate)
            if i == 0:  # one grammar for every prompt of the batch
                await self.check_grammar(req, params)
            echo = "" if not req.echo else prompt if isinstance(prompt, str) else self._decode(ids)
            prompts.append((ids, params, echo))
        return expand(prompts, req.num_choices())

    def _decode(self, ids: list[int]) -> str:
        decode = getattr(self.tokenizer, "decode", None)
        return str(decode(ids)) if decode is not None else ""

    def check_prompt(self, prompt_ids: list[int], max_tokens: int | None) -> int:
        """Validate token ids and length; return the max_tokens to use (see api.limits)."""
        return request_limits.check_prompt(prompt_ids, max_tokens, self.limits)

    async def check_routed(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Work the router sends (/internal/*) held to the public path's limits, so bad data never reaches the
        engine; its grammar compiles here (the grammar pool, its budget; cached for the engine)."""
        self.check_prompt(prompt_ids, params.max_tokens)
        self.check_request(prompt_ids, params)
        await self.check_grammar(None, params)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Stop ids in the vocabulary, then the params' and the engine's own validation, as a 400."""
        request_limits.check_stop_ids(params.stop_token_ids, self.limits, params.logit_bias)
        request_limits.check_engine(prompt_ids, params, self.validate)

    # ------------------------------------------------------------------ running
    def run(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, arrival: float | None = None,
        span: tracing.Span = tracing.NO_SPAN,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the engine's outputs, with deadline, metrics, and abort on any early exit.

        The request counts as in flight (and queued) from this call on, not from the first
        iteration, so an admit() right after sees it: the queue bound holds under bursts. A stream
        that is never iterated (e.g. the client left before the response started) is released
        when it is garbage-collected. Callers should iterate inside `contextlib.aclosing` so an
        early exit runs the cleanup at once.
        """
        self.metrics.request_accepted(len(prompt_ids))
        self.in_flight += 1
        self.pending += 1
        self._idle.clear()
        started = [False]
        stream = self._run(started, request_id, prompt_ids, params, arrival or time.monotonic(), span)
        weakref.finalize(stream, self._release_unstarted, started)
        return stream

    def _release_unstarted(self, started: list[bool]) -> None:
        if not started[0]:
            started[0] = True
            self._done(pending=True)

    def _done(self, pending: bool) -> None:
        if pending:
            self.pending -= 1
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def tracked(self, stream: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
        """``stream`` (an /internal/* response) counted as in flight from now until it ends. A prefill's
        stream ends once its KV reached the decode worker (or failed), a decode's at its last token: a drain
        (``/drain?wait=true``, what the operator asks before a scale-down) waits for both, so no decode is left
        needing the KV of a pod that is going away. A stream never iterated (the client left before the
        response started) is released when it is garbage-collected."""
        self.in_flight += 1
        self._idle.clear()
        released = [False]

        def release() -> None:
            if not released[0]:
                released[0] = True
                self._done(pending=False)

        async def run() -> AsyncGenerator[bytes, None]:
            try:
                async for chunk in stream:
                    yield chunk
            finally:
                release()
                close = getattr(stream, "aclose", None)
                if close is not None:  # its own cleanup (abort a save, free blocks) runs now, not at GC
                    await close()

        gen = run()
        weakref.finalize(gen, release)
        return gen

    async def _run(
        self, started: list[bool], request_id: str, prompt_ids: list[int], params: SamplingParams, arrival: float,
        span: tracing.Span = tracing.NO_SPAN,
    ) -> AsyncGenerator[RequestOutput, None]:
        if started[0]:  # already released by the finalizer: cannot happen while we are referenced
            return
        started[0] = True
        loop = asyncio.get_running_loop()
        deadline = None if self.request_timeout is None else loop.time() + self.request_timeout - (
            time.monotonic() - arrival
        )
        waiting_first, finished = True, False
        last = arrival
        first_at: float | None = None
        stream: AsyncIterator[RequestOutput] | None = None
        phases = tracing.observed(self.metrics, span)  # the metrics, plus phase spans when tracing is on
        try:
            stream = self.engine.generate(request_id, prompt_ids, params)
            while not finished:
                try:
                    if deadline is None:  # no --request-timeout: no timer to arm and cancel every token
                        out = await anext(stream)
                    else:
                        async with asyncio.timeout_at(deadline):
                            out = await anext(stream)
                except StopAsyncIteration:
                    break
                except ValueError as e:
                    if not waiting_first:
                        raise
                    # the engine refused the request before producing anything: the client's fault
                    raise errors.bad_request(str(e)) from None
                except TimeoutError:
                    self.metrics.rejected("timeout")
                    raise errors.timeout(self.request_timeout or 0.0) from None
                now = time.monotonic()
                n = len(out.new_token_ids)
                if n:
                    if waiting_first:
                        waiting_first = False
                        self.pending -= 1
                        self.metrics.observe_ttft(now - arrival)
                        observe_prefill(phases, out, arrival, now)
                        first_at = now
                    else:
                        self.metrics.observe_tpot((now - last) / n)
                    last = now
                    self.metrics.tokens_generated(n)
                finished = out.finished
                if finished:
                    if first_at is not None:
                        phases.phase("decode", now - first_at)
                    phases.request_finished(out.finish_reason, len(prompt_ids), out.completion_tokens,
                                                  now - arrival)
                yield out
        finally:
            self._done(pending=waiting_first)
            if not finished:
                self.abort_soon(request_id)
            aclose = getattr(stream, "aclose", None) if stream is not None else None
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # the engine's own cleanup failing must not mask our error
                    log.exception("closing the engine stream of %s failed", request_id)

    def abort_soon(self, request_id: str) -> None:
        """Abort without awaiting: this runs in `finally` blocks of responses cancelled by a client
        disconnect, where Starlette's cancelled scope would cancel any await (and leak the blocks)."""
        try:
            res = self.engine.abort(request_id)
        except Exception:
            log.exception("engine.abort(%s) failed", request_id)
            return
        if inspect.isawaitable(res):
            task = asyncio.ensure_future(res)
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def abort(self, request_id: str) -> None:
        try:
            res = self.engine.abort(request_id)
            if inspect.isawaitable(res):
                await res
        except Exception:
            log.exception("engine.abort(%s) failed", request_id)
