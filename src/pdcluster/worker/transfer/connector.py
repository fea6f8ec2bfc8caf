"""The KV transfer backend: an implementation of the engine's KV connector interface
(`pdcluster.worker.engine.kv_connector`), named after vLLM's KV connector API so that an RDMA/NIXL transport
can replace TCP without touching the worker.

Producer (prefill worker), per request:
    start_save(request_id, target, num_layers)  -> the engine calls save_kv_layer(...) once per layer and
    prefill chunk, on its own thread -> await wait_for_save(request_id)  (or abort_save on failure)
Consumer (decode worker), per request:
    start_load_kv(spec) after reserving cache blocks -> frames arrive -> importer writes each layer ->
    await wait_for_layer_load(request_id, layer) / wait_for_load(request_id) -> finish_load or cancel_load
Both: get_finished() -> (finished sending, finished receiving) since the previous call, as in vLLM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import inspect
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator

import torch

from pdcluster.kernels import native
from pdcluster.worker.transfer import chunking, codec, handoff, placing, views
from pdcluster.worker.transfer.chancache import ChannelCache
from pdcluster.worker.transfer.channel import FATAL, Placement, TransferError, TransportStats
from pdcluster.worker.transfer.frame import DEFAULT_LIMITS, ErrorCode, Frame, Header, Kind, Limits
from pdcluster.worker.transfer.head_slice import Fanout, HeadRoute
from pdcluster.worker.transfer.interface import KVConnector
from pdcluster.worker.transfer.lending import Lender
from pdcluster.worker.transfer.options import TransferOptions
from pdcluster.worker.transfer.outbox import Outbox
from pdcluster.worker.transfer.specs import LoadSpec, Received, SaveResult, TransferTarget, _Load
from pdcluster.worker.transfer.transport import KVServer

log = logging.getLogger(__name__)
INLINE_MAX = 4 * 1024 * 1024  # bytes of K+V up to which a layer is framed on the caller's thread (`_inline`)

# Importer: (request_id, layer, k, v, token_start=..., scales=...) for tokens [token_start, +k.shape[0]) of a
# layer, as the wire carried them (codec.wire_kv: float values, or int8/int4 codes with their float32 scales),
# as views of receive memory that is reused once it returns; may be a coroutine function (the worker hands the
# write to its engine thread). It must only write into blocks already reserved for request_id.
Importer = Callable[..., None | Awaitable[None]]


class TCPConnector(KVConnector):
    """KV over the framed TCP transport, with optional int8 compression on the wire."""

    _streams = True  # int8 compression: frames leave one by one as the encoder quantizes (chunking.py)
    _sends_views = True  # float layers sent from the engine's cache blocks (save_kv_views, views.py)

    def __init__(self, secret: bytes, options: TransferOptions, *, importer: Importer | None = None,
                 limits: Limits = DEFAULT_LIMITS, chunk_bytes: int = 64 * 1024 * 1024, encoder_threads: int = 4,
                 destination: placing.Destination | None = None) -> None:
        # the knobs come from the worker's flags (transfer/options.py, checked there): none is defaulted here
        self.options = options
        # mac: every byte of KV is tagged and checked; fabric: the payloads go untagged and untagged ones are
        # accepted (headers, request ids and scales stay tagged; the connection stays authenticated)
        self.integrity = options.integrity
        limits = dataclasses.replace(limits, trust_fabric=options.integrity == "fabric")
        self.secret, self.importer, self.compression = secret, importer, options.compression
        # float layers received straight into the cache, no importer call (placing.py); the owner must call
        # cancel_load before it frees a request's blocks
        self.destination = destination
        self.timeout, self.max_retries, self.limits = options.timeout_s, options.max_retries, limits
        self.chunk_bytes = min(chunk_bytes, limits.max_frame_bytes // 2)
        self.stats = TransportStats()
        self.server: KVServer | None = None
        self._outboxes: dict[str, tuple[Outbox | Fanout, int]] = {}
        self._loads: dict[str, _Load] = {}
        self._sent: set[str] = set()
        self._recvd: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Encoder threads keep quantize/serialize/HMAC off both the engine's forward pass and the event loop;
        # several, because HMAC-SHA256 is the transfer's CPU ceiling and hashlib releases the GIL (frames
        # are keyed by (layer, token_start), so their order on the wire does not matter).
        self._encoder = concurrent.futures.ThreadPoolExecutor(
            max(1, min(encoder_threads, os.cpu_count() or 1)), thread_name_prefix="kv-encode")
        self._encoding: dict[str, list[concurrent.futures.Future[list[tuple[Outbox, Frame]]]]] = {}
        self._lender, self._channels = Lender(2 * limits.max_frame_bytes), ChannelCache()

    async def listen(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self._loop = asyncio.get_running_loop()
        self.server = KVServer(self.secret, self._on_frame, limits=self.limits, stats=self.stats,
                               frame_timeout=self.timeout, recycle=True,  # the importer copies: bodies reused
                               place=self._place if self.destination is not None else None)
        return await self.server.start(host, port)

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()
        for rid in list(self._outboxes):
            await self.abort_save(rid)
        self._channels.close()
        self._encoder.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ producer
    def start_save(self, request_id: str, target: TransferTarget, num_layers: int) -> None:
        self._loop = asyncio.get_running_loop()
        box = self._box(target.host, target.port)
        self._lender.open(request_id, [box])
        self._outboxes[request_id] = (box, num_layers)

    def start_save_heads(self, request_id: str, routes: list[HeadRoute], num_layers: int) -> None:
        """A transfer of head ranges of this sender's cache, one per route (TP re-sharding, head_slice.py):
        then save_kv_layer / wait_for_save / abort_save as for start_save."""
        self._loop = asyncio.get_running_loop()
        boxes = [self._box(r.host, r.port) for r in routes]
        self._lender.open(request_id, boxes)
        self._outboxes[request_id] = (Fanout(routes, boxes), num_layers)

    def _box(self, host: str, port: int) -> Outbox:
        return Outbox(host, port, self.secret, timeout=self.timeout, max_retries=self.max_retries,
                      limits=self.limits, stats=self.stats, channels=self._channels)

    def export_buffer(self, request_id: str, layer: int, token_start: int, nbytes: int,
                      quantized: bool) -> torch.Tensor | None:
        """Engine thread: pooled host memory to gather into, back once its frames are ACKed (lending.py)."""
        return self._lender.lend(request_id, nbytes) if request_id in self._outboxes and nbytes > 0 else None

    def save_kv_layer(self, request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor,
                      token_start: int = 0, scales: codec.Scales | None = None) -> None:
        """Thread-safe and non-blocking: encoding runs on an encoder thread (or here, `_inline`), sending on the loop.
        `token_start` > 0 ships a later token range of the layer (chunked prefill); codes with `scales` (a
        quantized cache's own layer) go as they are."""
        entry = self._outboxes.get(request_id)
        if entry is None or self._loop is None:
            self._dropped(k)
            return  # aborted meanwhile: drop silently, the abort already told the receiver
        box, num_layers = entry
        loop = self._loop

        def encode() -> list[tuple[Outbox, Frame]]:
            to = box  # a local, which isinstance narrows (the closure's `box` it does not)
            if isinstance(to, Fanout):
                return to.frames(lambda k, v, s, h: self._frames(request_id, layer, num_layers, k, v, token_start,
                                                                 s, head_start=h), k, v, scales)
            if stream:  # each frame to the loop as soon as it is built: the next one is encoded meanwhile
                for f in self._frame_iter(request_id, layer, num_layers, k, v, token_start, scales):
                    loop.call_soon_threadsafe(put, handoff.done([(to, f)]))
                return []
            return [(to, f) for f in self._frames(request_id, layer, num_layers, k, v, token_start, scales)]

        def enqueue(fut: concurrent.futures.Future[list[tuple[Outbox, Frame]]]) -> None:
            loop.call_soon_threadsafe(put, fut)

        def put(fut: concurrent.futures.Future[list[tuple[Outbox, Frame]]]) -> None:  # on the loop
            try:
                frames = fut.result()
            except Exception:  # e.g. an unsupported dtype: fail this transfer only
                log.exception("kv transfer %s: encoding layer %d failed", request_id, layer)
                if request_id in self._outboxes:
                    box.close()
                return
            if request_id in self._outboxes:
                for b, f in frames:
                    b.put(f)

        uses_buffer = scales is not None or self.compression != "int8"
        stream = not uses_buffer and not isinstance(box, Fanout) and self._streams
        if self._inline(box, k, uses_buffer):
            # Nothing to compute (views of the export; the tags are the loop's): build the frames here and,
            # on the loop's own thread, queue them at once. The hop through an encoder thread and back was
            # most of a small layer's fixed cost (two thread wake-ups per transfer).
            try:
                done = handoff.done(self._lender.encode(request_id, self._lender.take(k), encode, uses_buffer))
            except Exception as e:
                done = handoff.done(error=e)
            (put if handoff.on_loop(loop) else enqueue)(done)
            return
        fut = self._encoder.submit(self._lender.encode, request_id, self._lender.take(k), encode,
                                   uses_buffer=uses_buffer)
        fut.add_done_callback(enqueue)
        self._encoding.setdefault(request_id, []).append(fut)

    def save_kv_views(self, request_id: str, layer: int, parts: list[memoryview], *, token_start: int,
                      num_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                      held: Callable[[], bool] | None = None) -> bool:
        """Engine thread: a float layer's token range sent from where it lies (`parts`: K's bytes, then V's;
        views.py says why that is safe; `held()` False: that memory was taken back), no export copy. False:
        not sent this way (head ranges, NIXL, int8 without the native quantizer): gather it for save_kv_layer."""
        entry = self._outboxes.get(request_id)
        if entry is None or self._loop is None:
            return True  # aborted meanwhile: nothing to send, the abort already told the receiver
        box, num_layers = entry
        if not self._sends_views or isinstance(box, Fanout):
            return False
        shape = dict(token_start=token_start, num_tokens=num_tokens, kv_heads=kv_heads, head_dim=head_dim)
        if self.compression == "int8":  # quantized here, from the views: with the native kernel, any size
            if dtype != torch.float32 or (2 * num_tokens * kv_heads * head_dim * 4 > INLINE_MAX
                                          and not native.quant_ready()):
                return False  # the torch quantizer is ~14x slower: a big layer pipelines on an encoder thread
            frames = views.quantized_frames(request_id, layer, num_layers, parts, **shape,
                                            frame_bytes=min(chunking.PIPE_BYTES, self.chunk_bytes))
        else:
            frames = views.view_frames(request_id, layer, num_layers, parts, **shape, dtype=dtype,
                                       chunk_bytes=self.chunk_bytes, held=held)
        loop = self._loop

        def put() -> None:  # on the loop, as save_kv_layer's frames; dropped once the save has ended
            for f in frames if request_id in self._outboxes else ():
                box.put(f)

        put() if handoff.on_loop(loop) else loop.call_soon_threadsafe(put)
        return True

    def _inline(self, box: Outbox | Fanout, k: torch.Tensor, uses_buffer: bool) -> bool:
        """Encode on the caller's thread: small layers whose frames are views of what the caller gave (no
        quantizing, no head ranges cut out; NIXL MACs them, ~0.2 ms at the limit). A big layer keeps the
        encoder thread: the hop is small next to its transfer, and the engine's thread stays free."""
        return uses_buffer and not isinstance(box, Fanout) and 2 * k.numel() * k.element_size() <= INLINE_MAX

    def _dropped(self, k: torch.Tensor) -> None:
        """A save_kv_layer that will not be sent (its request is gone): memory lent by export_buffer comes back."""
        self._lender.give(self._lender.take(k))

    def _frames(self, request_id: str, layer: int, num_layers: int, k: torch.Tensor, v: torch.Tensor,
                offset: int, scales: codec.Scales | None = None, head_start: int = 0) -> list[Frame]:
        return list(self._frame_iter(request_id, layer, num_layers, k, v, offset, scales, head_start))

    def _frame_iter(self, request_id: str, layer: int, num_layers: int, k: torch.Tensor, v: torch.Tensor,
                    offset: int, scales: codec.Scales | None = None, head_start: int = 0) -> Iterator[Frame]:
        return chunking.layer_frames(request_id, layer, num_layers, k, v, offset=offset, scales=scales,
                                     head_start=head_start, compression=self.compression,
                                     chunk_bytes=self.chunk_bytes)

    async def wait_for_save(self, request_id: str) -> SaveResult:
        """All layers acknowledged by the receiver; returns seconds from first frame to last ACK."""
        entry = self._outboxes.get(request_id)
        if entry is None:
            raise TransferError(f"no transfer started for {request_id}")
        box = entry[0]
        # Frames still being encoded must reach the outbox before it is closed. Each future's own done
        # callback (enqueue) was registered first, so its put() is scheduled before this await resumes.
        for fut in self._encoding.pop(request_id, []):
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(fut)
        await asyncio.sleep(0)
        try:
            seconds = await box.wait()
        except TransferError:
            self._outboxes.pop(request_id, None)
            self._lender.forget(request_id)
            await box.abort()
            raise
        self._outboxes.pop(request_id, None)
        self._lender.forget(request_id)
        self.stats.durations.append(seconds)
        self._sent.add(request_id)
        return SaveResult(seconds, box.total_bytes)

    async def abort_save(self, request_id: str) -> None:
        self._encoding.pop(request_id, None)
        entry = self._outboxes.pop(request_id, None)
        self._lender.forget(request_id)
        if entry is not None:
            await entry[0].abort()

    # ------------------------------------------------------------------ consumer
    def start_load_kv(self, spec: LoadSpec) -> None:
        self._loads[spec.request_id] = _Load(spec)

    def cancel_load(self, request_id: str) -> None:
        load = self._loads.pop(request_id, None)
        if load is not None:
            load.error = load.error or "cancelled"
            load.changed.set()

    async def settle(self, request_id: str, timeout: float = 660.0) -> bool:
        """After `cancel_load`, before the owner frees the request's blocks: True once nothing more can be
        written into them. Here at once (placed receives check `alive` first); NIXL waits for READs in flight."""
        return True

    def finish_load(self, request_id: str) -> tuple[int, float]:
        """Forget a completed load; returns (payload bytes received, seconds since start_load_kv)."""
        load = self._loads.pop(request_id, None)
        return (load.bytes, time.monotonic() - load.started) if load else (0, 0.0)

    def pending_loads(self) -> list[tuple[str, float]]:
        """(request_id, started) of loads not finished/cancelled: the worker's reaper expires these."""
        return [(rid, ld.started) for rid, ld in self._loads.items()]

    async def wait_for_layer_load(self, request_id: str, layer: int) -> None:
        await self._wait(request_id, lambda ld: layer in ld.loaded)

    async def wait_for_load(self, request_id: str, timeout: float | None = None) -> None:
        async with asyncio.timeout(timeout):
            await self._wait(request_id, lambda ld: len(ld.loaded) == ld.spec.num_layers)

    async def _wait(self, request_id: str, done: Callable[[_Load], bool]) -> None:
        while True:
            load = self._loads.get(request_id)
            if load is None:
                raise TransferError(f"no load pending for {request_id}", ErrorCode.UNKNOWN_REQUEST)
            if load.error:
                raise TransferError(f"kv load for {request_id} failed: {load.error}")
            if done(load):
                return
            load.changed.clear()
            await load.changed.wait()

    def _place(self, hdr: Header, request_id: str) -> Placement | None:
        load = self._loads.get(request_id)
        assert self.destination is not None
        return placing.claim(load, hdr, request_id, self.destination, lambda: self._loads.get(request_id) is load)

    async def _on_frame(self, frame: Frame) -> ErrorCode:
        load = self._loads.get(frame.request_id)
        if load is None or load.error:
            return ErrorCode.UNKNOWN_REQUEST
        if frame.placed:  # already in the cache, tags checked (placing.py): only the bookkeeping is left
            load.bytes += len(frame.payload)
            return self._imported(load, frame)
        if frame.kind == Kind.ABORT:
            load.error = "sender aborted the transfer"
            load.changed.set()
            return ErrorCode.OK
        if frame.kind not in (Kind.LAYER, Kind.STAGED):
            return ErrorCode.BAD_HEADER
        s = load.spec
        if not placing.fits(s, frame):
            load.error = (f"shape mismatch: got layers={frame.num_layers} heads={frame.kv_heads} from head "
                          f"{frame.head_start} dim={frame.head_dim} tokens<{frame.token_end}, expected {s}")
            load.changed.set()
            return ErrorCode.SHAPE_MISMATCH
        ranges = load.ranges.setdefault(frame.layer, {})
        key = (frame.token_start, frame.head_start)
        if frame.layer in load.loaded or key in ranges:
            return ErrorCode.OK  # a resend after reconnect: already imported (or being imported)
        ranges[key] = 0
        try:
            got = await self._decode(frame)
        except TransferError as e:  # e.g. a staged layer whose MAC fails: this load is over
            ranges.pop(key, None)
            if e.code in FATAL:
                load.error = str(e)
                load.changed.set()
            return e.code or ErrorCode.INTERNAL
        try:
            if frame.request_id not in self._loads:  # cancelled while receiving
                return ErrorCode.UNKNOWN_REQUEST
            if self.importer is not None and not got.placed:
                # a head range says where it goes in this cache; a whole-layer load calls as it always did
                heads = {"head_offset": frame.head_start - s.head_offset} if s.pieces else {}
                res = self.importer(frame.request_id, frame.layer, got.k, got.v, token_start=frame.token_start,
                                    scales=got.scales, **heads)
                if inspect.isawaitable(res):
                    await res
        except Exception as e:  # e.g. the reservation vanished: fail this load, not the listener
            log.exception("kv transfer %s: importing layer %d failed", frame.request_id, frame.layer)
            load.error = f"import failed: {e}"
            load.changed.set()
            return ErrorCode.UNKNOWN_REQUEST
        finally:
            got.release()  # the importer has copied the bytes into the cache: the receive memory is free
        load.bytes += got.nbytes
        return self._imported(load, frame)

    def _imported(self, load: _Load, frame: Frame) -> ErrorCode:
        """A data frame's range is in the cache: the layer (and the request) may be complete."""
        s, ranges = load.spec, load.ranges.setdefault(frame.layer, {})
        ranges[(frame.token_start, frame.head_start)] = frame.num_tokens * frame.kv_heads
        if sum(ranges.values()) >= s.num_tokens * s.kv_heads:
            load.loaded.add(frame.layer)
            del load.ranges[frame.layer]
            if len(load.loaded) == s.num_layers:
                self._recvd.add(frame.request_id)
        load.changed.set()
        return ErrorCode.OK

    async def _decode(self, frame: Frame) -> Received:
        """K and V of one data frame as views of its receive buffer (no copy, no compute: dequantizing, if
        the cache wants it, is the importer's). This backend takes LAYER frames only."""
        if frame.kind != Kind.LAYER:
            raise TransferError("a STAGED (NIXL) frame reached a TCP-only receiver: run both sides with the "
                                "same --kv-transfer-backend", ErrorCode.UNSUPPORTED)
        k, v, scales = codec.wire_kv(frame)
        return Received(k, v, scales, len(frame.payload) + len(frame.scales))

    # ------------------------------------------------------------------ both
    def get_finished(self) -> tuple[set[str], set[str]]:
        sent, recvd = self._sent, self._recvd
        self._sent, self._recvd = set(), set()
        return sent, recvd
