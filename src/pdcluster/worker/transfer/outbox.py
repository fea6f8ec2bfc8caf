"""The KV transport's sending side: one outgoing transfer over one authenticated connection at a time.

Frames are pipelined (the sender does not wait for an ACK before writing the next layer) and kept, as
frames, until their ACK arrives: a broken connection is repaired by reconnecting (a new handshake, new
keys) and resealing only what was not acknowledged — bounded by `max_retries` and one deadline for the
whole transfer. Payloads go to the socket from where they lie (scatter-gather), never joined or copied.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from pdcluster.worker.transfer.chancache import ChannelCache
from pdcluster.worker.transfer.channel import FATAL, Channel, TransferError, TransportStats, open_channel
from pdcluster.worker.transfer.frame import DEFAULT_LIMITS, ErrorCode, Frame, FrameError, Kind, Limits

log = logging.getLogger(__name__)
RETRYABLE = (OSError, EOFError, FrameError)


class Outbox:
    """One outgoing transfer: frames are queued (from any coroutine), pipelined, and resent on reconnect.

    Usage: `put(frame)` for each frame, `close()` when no more will come, then `await wait()`.
    """

    def __init__(self, host: str, port: int, secret: bytes, *, timeout: float, max_retries: int,
                 limits: Limits = DEFAULT_LIMITS, stats: TransportStats | None = None,
                 channels: ChannelCache | None = None) -> None:
        self.host, self.port, self.secret, self.limits = host, port, secret, limits
        self.channels = channels  # connections kept between transfers (chancache.py); None: one per transfer
        self._kept = False  # the connection in use was taken from `channels`
        self.timeout, self.max_retries = timeout, max_retries
        self.stats = stats or TransportStats()
        self._frames: dict[tuple[int, int], Frame] = {}  # (layer, token_start) -> frame, until ACKed
        self._order: list[tuple[int, int]] = []
        self._more = asyncio.Event()
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        self._started = 0.0
        self.request_id = ""
        self.on_ack: Callable[[Frame], None] | None = None  # a frame the receiver accepted (NIXL: free its staging)
        self.attempts = 0
        self.total_bytes = 0

    def put(self, frame: Frame) -> None:
        if self._closed:
            raise RuntimeError("outbox is closed")
        self.request_id = frame.request_id
        key = (frame.layer, frame.token_start)
        self._frames[key] = frame
        self.total_bytes += len(frame.payload) + len(frame.scales)
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
                    chan = await open_channel(self.host, self.port, self.secret, self.limits)
                    try:
                        await chan.send(Frame(kind=Kind.ABORT, request_id=self.request_id))
                    finally:
                        chan.close()

    async def _run(self) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                while True:
                    try:
                        await self._one_connection()
                        return
                    except RETRYABLE as e:
                        if isinstance(e, FrameError) and e.code in FATAL:
                            raise TransferError(f"kv transfer to {self.host}:{self.port}: {e}", e.code) from e
                        if self._kept:  # a kept connection the receiver closed meanwhile: not an attempt
                            log.info("kv transfer %s: kept connection failed (%s), reconnecting", self.request_id, e)
                            continue
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
        chan = self.channels.get(self.host, self.port) if self.channels is not None else None
        self._kept = chan is not None
        if chan is None:
            chan = await open_channel(self.host, self.port, self.secret, self.limits)
        acks = asyncio.ensure_future(self._read_acks(chan))
        keep = False
        try:
            sent = 0
            while True:
                while sent < len(self._order):
                    frame = self._frames.get(self._order[sent])
                    sent += 1
                    if frame is not None and frame.held is not None and not frame.held():
                        raise TransferError(f"kv transfer {self.request_id}: the sender's cache blocks were "
                                            f"released before layer {frame.layer} was sent")  # views.py
                    if frame is not None:  # None: already ACKed on a previous connection
                        self.stats.bytes_sent += await chan.send(frame)
                if self._closed:
                    break
                self._more.clear()
                if sent < len(self._order):
                    continue  # a frame arrived while we were sending
                more = asyncio.ensure_future(self._more.wait())
                await asyncio.wait({more, acks}, return_when=asyncio.FIRST_COMPLETED)
                more.cancel()
                if acks.done():
                    acks.result()  # raises whatever ended the reader early
            if self._frames:
                await acks
            # every frame ACKed, the ACK reader not failed: nothing in flight, the next transfer may use it
            keep = not self._frames and not (acks.done() and (acks.cancelled() or acks.exception() is not None))
        except OSError:
            # The receiver may have refused a frame (fatal) and closed: report that, not the broken pipe.
            if acks.done() and not acks.cancelled() and isinstance(acks.exception(), TransferError):
                raise acks.exception() from None  # type: ignore[misc]
            raise
        finally:
            acks.cancel()
            if keep and self.channels is not None:
                self.channels.put(self.host, self.port, chan)
            else:
                chan.close()

    async def _read_acks(self, chan: Channel) -> None:
        while self._frames or not self._closed:
            frame = await chan.read_frame()
            if frame.kind != Kind.ACK:
                raise FrameError(ErrorCode.BAD_HEADER, f"expected ACK, got {frame.kind.name}")
            code = ErrorCode(frame.status) if frame.status in ErrorCode._value2member_map_ else ErrorCode.INTERNAL
            if code != ErrorCode.OK:
                if code in FATAL:
                    hint = (" (the two sides run different --kv-transfer-backend or --kv-transfer-integrity)"
                            if code == ErrorCode.UNSUPPORTED else "")
                    raise TransferError(f"receiver refused layer {frame.layer}: {code.name}{hint}", code)
                raise FrameError(code, f"receiver reported {code.name} for layer {frame.layer}")
            done = self._frames.pop((frame.layer, frame.token_start), None)
            if done is not None and self.on_ack is not None:
                self.on_ack(done)
