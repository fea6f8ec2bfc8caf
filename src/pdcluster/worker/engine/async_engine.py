"""AsyncEngine: the LLMEngine on a background thread, with per-request async output streams.

The engine is not thread-safe, so only its own thread touches it: everything else (adding, aborting,
KV import/export for disaggregation) is a command queued to that thread and run between two steps
(`call`). Torch releases the GIL inside kernels, so the event loop stays responsive while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from pdcluster.kernels import native
from pdcluster.worker.engine.config import ModelConfig
from pdcluster.worker.engine.kv_connector import KVConnectorBase, KVLayout
from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine
from pdcluster.worker.engine.outputs import RequestOutput
from pdcluster.worker.engine.sampling_params import SamplingParams
from pdcluster.worker.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)
T = TypeVar("T")
NATIVE_LOADED = "native_kernel_loaded:"  # + a native module's name, in stats(): 1 native, 0 its torch path


class RequestStream:
    """Outputs of one request, delivered from the engine thread into an asyncio queue."""

    def __init__(self, owner: AsyncEngine, request_id: str) -> None:
        self.owner, self.request_id = owner, request_id
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished = False

    def put(self, out: RequestOutput) -> None:  # engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, out)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self.queue.get()
        if out.finished:
            self.finished = True
            self.owner._streams.pop(self.request_id, None)
        return out

    def close(self) -> None:
        """Stop listening; a request that has not finished is aborted (its KV blocks are freed)."""
        if not self.finished:
            self.finished = True
            self.owner._streams.pop(self.request_id, None)
            self.owner.abort(self.request_id)


DRAIN_ENV = "PDCLUSTER_ENGINE_DRAIN_WAIT_MS"
DEFAULT_DRAIN_WAIT_MS = 10.0


def drain_wait_s() -> float:
    """How long the engine thread waits, after a step, for the event loops to write that step's outputs
    (``PDCLUSTER_ENGINE_DRAIN_WAIT_MS``, default 10; 0 = not at all)."""
    raw = os.environ.get(DRAIN_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_DRAIN_WAIT_MS
    except ValueError:
        raise ValueError(f"{DRAIN_ENV} must be a number of milliseconds >= 0, not {raw!r}") from None
    if not 0.0 <= value <= 1000.0:
        raise ValueError(f"{DRAIN_ENV} must be in [0, 1000] milliseconds, not {raw!r}")
    return value / 1e3


def _put_all(items: list[tuple[RequestStream, RequestOutput]], drained: threading.Event | None) -> None:
    # on the streams' event loop
    for stream, out in items:
        stream.queue.put_nowait(out)
    if drained is not None:  # behind the streams the puts just woke: set once they have written their chunks
        asyncio.get_running_loop().call_soon(drained.set)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self._stats: dict[str, float | int] = engine.stats()
        self._drain_wait = drain_wait_s()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(LLMEngine(config))

    # -- lifecycle --------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="pdcluster-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    # -- read-only views (any thread) -------------------------------------------------------------------
    # Fixed when the engine is built and never reassigned, so reading them off the engine thread is safe.

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def kv_layout(self) -> KVLayout:
        return self.engine.kv_layout

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the engine would reject this request; callable from any thread.

        Pure checks against fixed limits (vocabulary, model length, total cache size); it reads no
        scheduler state, so it need not be queued to the engine thread."""
        self.engine.validate_request(prompt_token_ids, params)

    # -- API --------------------------------------------------------------------------------------------

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return (or raise) its result."""
        self.start()
        fut: Future[T] = Future()
        self._commands.put((fn, fut))
        self._wake.set()
        return await asyncio.wrap_future(fut)

    def open_stream(self, request_id: str) -> RequestStream:
        """Listen for a request's outputs; open it before the request can produce any (e.g. commit_import)."""
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        return stream

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs as they are produced. Raises ValueError (before any output) for an invalid request.
        Leaving the loop early (client disconnect, cancellation) aborts the request and frees its blocks."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = self.open_stream(request_id)
        try:
            await self._compile(params)
            await self.call(
                lambda e: e.add_request(request_id, prompt_token_ids, params, prefill_only=prefill_only)
            )
        except BaseException:
            stream.finished = True
            self._streams.pop(request_id, None)
            raise
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def _compile(self, params: SamplingParams) -> None:
        """A structured-output grammar is compiled on a worker thread (cached), so neither the event loop nor
        the engine thread (every running request's next token) waits for it; the engine then finds it cached."""
        if params.structured_kind:  # its own thread: plain requests' tokenizing never waits behind a compile
            await asyncio.get_running_loop().run_in_executor(self.engine.grammar.executor, self.engine.compile_grammar,
                                                             params)

    def abort(self, request_id: str) -> None:
        """Abort from any thread; the request's stream (if any) ends with finish_reason "abort"."""

        def _abort(engine: LLMEngine) -> None:
            if engine.abort(request_id):
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.put(RequestOutput(request_id, [], finished=True, finish_reason="abort"))

        self._commands.put((_abort, Future()))
        self._wake.set()

    # -- disaggregation: the engine's KV connector and its import side (see kv_connector.py) -----------

    async def set_kv_connector(self, connector: KVConnectorBase | None) -> None:
        await self.call(lambda e: e.set_kv_connector(connector))

    async def reserve_for_import(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> bool:
        await self._compile(params)
        return await self.call(lambda e: e.reserve_for_import(request_id, prompt_token_ids, params))

    async def import_kv_layer(self, request_id: str, layer: int, k: Any, v: Any, **where: Any) -> None:
        await self.call(lambda e: e.import_kv_layer(request_id, layer, k, v, **where))  # token_start, scales

    async def commit_import(self, request_id: str, first_token_id: int) -> None:
        await self.call(lambda e: e.commit_import(request_id, first_token_id))

    async def cancel_import(self, request_id: str) -> None:
        await self.call(lambda e: e.cancel_import(request_id))

    async def release(self, request_id: str) -> None:
        """Free the blocks a finished prefill-only request kept for export."""
        await self.call(lambda e: e.release(request_id))

    def stats(self) -> dict[str, float | int]:
        """Engine gauges and counters as of the last step, and the native kernels' pool counters as of now
        (safe from any thread). The pool's are read here, at scrape time, not after every step: calls, how many
        a helper thread shared, and stalls (a helper lost its core, so the next calls ran alone); and, per
        native module this process asked for, whether it loaded (NATIVE_LOADED)."""
        pool = native.loaded_pool_stats()
        keys = ("calls", "shared_calls", "stalls")
        loaded = {f"{NATIVE_LOADED}{name}": int(ok) for name, ok in native.outcomes().items()}
        return {**self._stats, **{f"native_pool_{k}": pool[k] for k in keys if k in pool}, **loaded}

    # -- the engine thread ------------------------------------------------------------------------------

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop:
            self._run_commands()
            if not engine.has_unfinished():
                self._stats = engine.stats()
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a broken step must not take the server down: fail what is in flight
                log.exception("engine step failed")
                outputs = self._fail_all(f"engine error: {type(e).__name__}: {e}")
            if engine.idle and not outputs:  # blocked (e.g. on blocks held for export): don't spin
                self._wake.wait(timeout=0.005)
                self._wake.clear()
            self._stats = engine.stats()  # before the outputs: a caller that saw them sees these stats
            for drained in self._deliver(outputs):
                drained.wait(self._drain_wait)

    def _deliver(self, outputs: list[RequestOutput]) -> list[threading.Event]:
        """Hand a step's outputs to their streams with one wake-up per event loop, not one per output: each
        call_soon_threadsafe is a self-pipe write and a loop iteration, and at batch 16 those 16 wake-ups per
        step were event-loop work competing with the next step for the same cores. Returns an event per loop,
        set once it has written them: the engine thread waits on these (up to ``drain_wait_s``) before the
        next step. Without the wait a loop gave up the GIL at every poll and the engine thread took it for the
        next step: one loop iteration a step, so streams fell behind by tens of ms, then delivered their
        tokens in bursts (eleventh pass)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, out))
        events: list[threading.Event] = []
        for loop, items in by_loop.items():
            drained = threading.Event() if self._drain_wait > 0 else None
            try:
                loop.call_soon_threadsafe(_put_all, items, drained)
            except RuntimeError:  # that loop is closed: nobody is listening any more
                log.debug("dropped %d outputs for a closed event loop", len(items))
                continue
            if drained is not None:
                events.append(drained)
        return events

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
                fut.set_exception(e)

    def _fail_all(self, message: str) -> list[RequestOutput]:
        outs = []
        for rid in list(self.engine.seqs):
            self.engine.abort(rid)
            outs.append(RequestOutput(rid, [], finished=True, finish_reason="error", error=message))
        return outs
