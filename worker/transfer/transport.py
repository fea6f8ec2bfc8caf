"""Asyncio TCP transport for KV frames: a server that verifies every frame, and a per-transfer sender.

One TCP connection per transfer. The sender pipelines frames (it does not wait for an ACK before writing
the next layer) and keeps each encoded frame until its ACK arrives, so a broken connection is repaired by
reconnecting and resending only what was not acknowledged — bounded by `max_retries` and by one deadline
for the whole transfer. The receiver acknowledges every frame with an (HMAC-signed) ACK carrying a status
code; a frame it cannot authenticate or parse ends that connection only, never the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from pdcluster.worker.transfer.frame import (
    DEFAULT_LIMITS,
    HEADER_SIZE,
    ErrorCode,
    Frame,
    FrameError,
    Header,
    Kind,
    Limits,
    ack,
    encode_frame,
    parse_body,
    parse_header,
)

log = logging.getLogger(__name__)

# Status codes that a retry on the same receiver cannot fix.
FATAL = {ErrorCode.UNKNOWN_REQUEST, ErrorCode.SHAPE_MISMATCH, ErrorCode.UNAUTHENTICATED,
         ErrorCode.BAD_VERSION, ErrorCode.TOO_LARGE}

FrameHandler = Callable[[Frame], Awaitable[ErrorCode]]


class TransferError(Exception):
    def __init__(self, message: str, code: ErrorCode = ErrorCode.INTERNAL) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class TransportStats:
    """Counters the worker exports as Prometheus metrics (read by disagg_routes)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    frames_rejected: int = 0
    failures: int = 0
    durations: list[float] = field(default_factory=list)  # seconds per completed send; drained by metrics


async def read_frame(reader: asyncio.StreamReader, secret: bytes, limits: Limits = DEFAULT_LIMITS,
                     timeout: float | None = None) -> Frame:
    """Read and verify exactly one frame. The body is read only after the header has been validated, so
    at most `limits.max_frame_bytes` is ever buffered. Raises FrameError or asyncio.IncompleteReadError."""
    async with asyncio.timeout(timeout):
        head = await reader.readexactly(HEADER_SIZE)
    return await _read_rest(reader, head, secret, limits, timeout)


# Above this, crc + HMAC run on a worker thread (hashlib and zlib release the GIL): a decode worker's event
# loop keeps streaming tokens while a big layer is verified.
OFFLOAD_BYTES = 256 * 1024


async def _read_rest(reader: asyncio.StreamReader, head: bytes, secret: bytes, limits: Limits,
                     timeout: float | None) -> Frame:
    hdr = parse_header(head, limits)
    try:
        async with asyncio.timeout(timeout):
            body = await reader.readexactly(hdr.body_len)
    except asyncio.IncompleteReadError as e:
        raise FrameError(ErrorCode.TRUNCATED, f"connection closed after {len(e.partial)} body bytes") from None
    if len(body) > OFFLOAD_BYTES:
        return await asyncio.to_thread(parse_body, hdr, head, body, secret)
    return parse_body(hdr, head, body, secret)


class KVServer:
    """Listens for KV frames; `handler` decides what each authenticated frame means."""

    def __init__(self, secret: bytes, handler: FrameHandler, *, limits: Limits = DEFAULT_LIMITS,
                 idle_timeout: float = 60.0, frame_timeout: float = 30.0,
                 stats: TransportStats | None = None, pipeline: int = 4) -> None:
        self.secret, self.handler, self.limits = secret, handler, limits
        self.idle_timeout, self.frame_timeout = idle_timeout, frame_timeout
        self.stats = stats or TransportStats()
        self.pipeline = max(1, pipeline)
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        # The stream limit only sets how much the socket may buffer before reading pauses (bounded per
        # connection); frame sizes are bounded by Limits, not by this.
        self._server = await asyncio.start_server(self._serve, host, port, limit=4 * 1024 * 1024)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for t in list(self._conns):
                t.cancel()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read frames back to back; verify and handle up to `pipeline` of them concurrently (HMAC is the
        CPU ceiling and releases the GIL), so reading the next frame overlaps checking this one."""
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        peer = writer.get_extra_info("peername")
        slots = asyncio.Semaphore(self.pipeline)
        inflight: set[asyncio.Task[None]] = set()
        try:
            while not writer.is_closing():
                try:
                    # An idle connection may wait idle_timeout for its next header; once a header is in,
                    # the peer gets frame_timeout for the body (a stalled sender cannot pin the buffer).
                    try:
                        async with asyncio.timeout(self.idle_timeout):
                            head = await reader.readexactly(HEADER_SIZE)
                    except asyncio.IncompleteReadError as e:
                        if not e.partial:
                            return  # clean close at a frame boundary
                        raise FrameError(ErrorCode.TRUNCATED, f"header cut after {len(e.partial)} bytes") from None
                    hdr = parse_header(head, self.limits)
                    try:
                        async with asyncio.timeout(self.frame_timeout):
                            body = await reader.readexactly(hdr.body_len)
                    except asyncio.IncompleteReadError as e:
                        raise FrameError(ErrorCode.TRUNCATED, f"closed after {len(e.partial)} body bytes") from None
                except (FrameError, TimeoutError) as e:
                    self._reject(writer, peer, e)
                    return
                await slots.acquire()
                t = asyncio.ensure_future(self._process(hdr, head, body, writer, peer))
                inflight.add(t)

                def done(t: asyncio.Task[None]) -> None:
                    inflight.discard(t)
                    slots.release()

                t.add_done_callback(done)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            if inflight:  # let verified frames get their ACKs before the connection goes
                with contextlib.suppress(BaseException):
                    await asyncio.gather(*inflight, return_exceptions=True)
            self._conns.discard(task)
            writer.close()

    def _reject(self, writer: asyncio.StreamWriter, peer: object, e: Exception) -> None:
        code = e.code if isinstance(e, FrameError) else ErrorCode.TRUNCATED
        self.stats.frames_rejected += 1
        log.warning("kv transfer: rejected frame from %s: %s", peer, e)
        # Framing (or trust) is lost after a bad frame: report once and drop this connection only.
        with contextlib.suppress(Exception):
            writer.write(encode_frame(ack("?", 0, code), self.secret))
            writer.close()

    async def _process(self, hdr: Header, head: bytes, body: bytes, writer: asyncio.StreamWriter,
                       peer: object) -> None:
        try:
            if len(body) > OFFLOAD_BYTES:
                frame = await asyncio.to_thread(parse_body, hdr, head, body, self.secret)
            else:
                frame = parse_body(hdr, head, body, self.secret)
        except FrameError as e:
            self._reject(writer, peer, e)
            return
        self.stats.bytes_received += len(frame.payload) + len(frame.scales)
        try:
            status = await self.handler(frame)
        except Exception:  # a bug in one transfer must not take the listener down
            log.exception("kv transfer: handler failed for %s layer %d", frame.request_id, frame.layer)
            status = ErrorCode.INTERNAL
        if frame.kind == Kind.LAYER and not writer.is_closing():
            reply = Frame(kind=Kind.ACK, request_id=frame.request_id, layer=frame.layer,
                          token_start=frame.token_start, token_end=frame.token_end, status=int(status))
            # ACKs are 70 bytes: no drain (several tasks share this writer, and the sender reads them).
            writer.write(encode_frame(reply, self.secret))


class Outbox:
    """One outgoing transfer: frames are queued (from any coroutine), pipelined, and resent on reconnect.

    Usage: `put(frame)` for each frame, `close()` when no more will come, then `await wait()`.
    """

    def __init__(self, host: str, port: int, secret: bytes, *, timeout: float = 30.0, max_retries: int = 2,
                 limits: Limits = DEFAULT_LIMITS, stats: TransportStats | None = None) -> None:
        self.host, self.port, self.secret, self.limits = host, port, secret, limits
        self.timeout, self.max_retries = timeout, max_retries
        self.stats = stats or TransportStats()
        self._frames: dict[tuple[int, int], bytes] = {}  # (layer, token_start) -> encoded, until ACKed
        self._order: list[tuple[int, int]] = []
        self._more = asyncio.Event()
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        self._started = 0.0
        self.request_id = ""
        self.attempts = 0
        self.total_bytes = 0

    def put(self, frame: Frame) -> None:
        if self._closed:
            raise RuntimeError("outbox is closed")
        self.request_id = frame.request_id
        key = (frame.layer, frame.token_start)
        self._frames[key] = data = encode_frame(frame, self.secret, self.limits)
        self.total_bytes += len(data)
        self._order.append(key)
        self._more.set()
        if self._task is None:  # the deadline starts with the first frame, not with prefill queueing
            self._started = time.monotonic()
            self._task = asyncio.ensure_future(self._run())

    def close(self) -> None:
        self._closed = True
        self._more.set()

    async def wait(self) -> float:
        """Block until every frame is acknowledged; returns seconds since the first frame. Raises TransferError."""
        self.close()
        if self._task is None:
            return 0.0
        await self._task
        return time.monotonic() - self._started

    async def abort(self) -> None:
        """Stop sending and tell the receiver (best effort) to drop what it has."""
        self._closed = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        if self.request_id:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    _, w = await asyncio.open_connection(self.host, self.port)
                    w.write(encode_frame(Frame(kind=Kind.ABORT, request_id=self.request_id), self.secret))
                    await w.drain()
                    w.close()

    async def _run(self) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                while True:
                    try:
                        await self._one_connection()
                        return
                    except (OSError, asyncio.IncompleteReadError, FrameError) as e:
                        if isinstance(e, FrameError) and e.code in FATAL:
                            raise TransferError(f"kv transfer to {self.host}:{self.port}: {e}", e.code) from e
                        self.attempts += 1
                        if self.attempts > self.max_retries:
                            raise TransferError(f"kv transfer to {self.host}:{self.port} failed after "
                                                f"{self.attempts} attempts: {e}") from e
                        log.info("kv transfer %s: retry %d after %s", self.request_id, self.attempts, e)
                        await asyncio.sleep(min(0.05 * 2**self.attempts, 1.0))
        except TimeoutError:
            self.stats.failures += 1
            raise TransferError(f"kv transfer to {self.host}:{self.port} timed out after {self.timeout:g} s") from None
        except TransferError:
            self.stats.failures += 1
            raise

    async def _one_connection(self) -> None:
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=1 << 16)
        acks = asyncio.ensure_future(self._read_acks(reader))
        try:
            sent = 0
            while True:
                while sent < len(self._order):
                    data = self._frames.get(self._order[sent])
                    sent += 1
                    if data is not None:  # None: already ACKed on a previous connection
                        writer.write(data)
                        self.stats.bytes_sent += len(data)
                        await writer.drain()
                if self._closed:
                    break
                self._more.clear()
                if sent < len(self._order):
                    continue  # a frame arrived while we were draining
                more = asyncio.ensure_future(self._more.wait())
                await asyncio.wait({more, acks}, return_when=asyncio.FIRST_COMPLETED)
                more.cancel()
                if acks.done():
                    acks.result()  # raises whatever ended the reader early
            if self._frames:
                await acks
        except (OSError, asyncio.IncompleteReadError):
            # The receiver may have refused a frame (fatal) and closed: report that, not the broken pipe.
            if acks.done() and not acks.cancelled() and isinstance(acks.exception(), TransferError):
                raise acks.exception() from None  # type: ignore[misc]
            raise
        finally:
            acks.cancel()
            writer.close()

    async def _read_acks(self, reader: asyncio.StreamReader) -> None:
        while self._frames or not self._closed:
            frame = await read_frame(reader, self.secret, self.limits)
            if frame.kind != Kind.ACK:
                raise FrameError(ErrorCode.BAD_HEADER, f"expected ACK, got {frame.kind.name}")
            code = ErrorCode(frame.status) if frame.status in ErrorCode._value2member_map_ else ErrorCode.INTERNAL
            if code != ErrorCode.OK:
                if code in FATAL:
                    raise TransferError(f"receiver refused layer {frame.layer}: {code.name}", code)
                raise FrameError(code, f"receiver reported {code.name} for layer {frame.layer}")
            self._frames.pop((frame.layer, frame.token_start), None)
