"""The KV transport's receiving side: a TCP server that authenticates each connection once (mutual
challenge-response, `handshake.py`), then verifies every frame's tags and hands it to a handler.

The sender is `outbox.Outbox`; the channel both share is `channel.py`. Memory before authentication is bounded: a peer that
cannot prove it holds the secret costs 69 bytes; at most `max_unauthenticated` connections may be in the
handshake at once (each for `auth_timeout`); a body is received straight into one buffer of its announced
size only after its header's tag checked, and all connections together hold at most `max_buffered_bytes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

from pdcluster.worker.transfer.bufpool import BufferPool
from pdcluster.worker.transfer.channel import (
    Channel,
    FrameHandler,
    Place,
    TransportStats,
    accept_channel,
    read_exact,
    read_placed,
)
from pdcluster.worker.transfer.frame import (
    DEFAULT_LIMITS,
    ErrorCode,
    Frame,
    FrameError,
    Header,
    Kind,
    Limits,
    ack,
)
from pdcluster.worker.transfer.sockio import Buffer, Conn

log = logging.getLogger(__name__)


class ByteBudget:
    """Bytes of frame bodies held at once by one receiver, across connections: a body is read only once
    its bytes are reserved here, and they come back when its frame has been handled."""

    def __init__(self, total: int) -> None:
        self.total, self.used = total, 0
        self._freed = asyncio.Event()

    async def acquire(self, n: int) -> None:
        if n > self.total:
            raise FrameError(ErrorCode.TOO_LARGE, f"frame body of {n} bytes exceeds the receive budget {self.total}")
        while self.used + n > self.total:
            self._freed.clear()
            await self._freed.wait()
        self.used += n

    def release(self, n: int) -> None:
        self.used -= n
        self._freed.set()


class KVServer:
    """Listens for KV connections; `handler` decides what each authenticated frame means."""

    def __init__(self, secret: bytes, handler: FrameHandler, *, limits: Limits = DEFAULT_LIMITS,
                 idle_timeout: float = 60.0, frame_timeout: float = 30.0,
                 stats: TransportStats | None = None, pipeline: int = 4, max_unauthenticated: int = 64,
                 auth_timeout: float = 10.0, max_buffered_bytes: int = 2 * DEFAULT_LIMITS.max_frame_bytes,
                 recycle: bool = False, place: Place | None = None) -> None:
        self.secret, self.handler, self.limits = secret, handler, limits
        self.idle_timeout, self.frame_timeout = idle_timeout, frame_timeout
        self.stats = stats or TransportStats()
        self.pipeline = max(1, pipeline)
        self.max_unauthenticated, self.auth_timeout = max_unauthenticated, auth_timeout
        self.budget = ByteBudget(max_buffered_bytes)
        # recycle: bodies are received into pooled memory, reused once the handler returned (a handler that
        # keeps a frame's payload past its return must not ask for this; the connector's importer copies)
        self.pool = BufferPool(max_buffered_bytes) if recycle else None
        # place: a float data frame's payload may be received straight into its destination (the cache)
        # instead of a buffer the handler then copies from (Placement in channel.py)
        self.place = place
        self.unauthenticated = 0  # connections still in the handshake
        self._sock: socket.socket | None = None
        self._accept: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)
        family, type_, proto, _, addr = infos[0]
        sock = socket.socket(family, type_, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._accept = asyncio.ensure_future(self._accept_loop(sock))
        return self.port

    async def close(self) -> None:
        if self._accept is not None:
            self._accept.cancel()
            with contextlib.suppress(BaseException):
                await self._accept
        if self._sock is not None:
            self._sock.close()
        for t in list(self._conns):
            t.cancel()
        if self._conns:
            await asyncio.gather(*self._conns, return_exceptions=True)

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                client, _ = await loop.sock_accept(sock)
            except OSError as e:  # e.g. EMFILE: back off instead of spinning
                log.warning("kv transfer: accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.ensure_future(self._serve(Conn(client)))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, conn: Conn) -> None:
        peer = conn.peer()
        if self.unauthenticated >= self.max_unauthenticated:
            self.stats.frames_rejected += 1
            log.warning("kv transfer: refused %s: %d connections already in the handshake", peer, self.unauthenticated)
            conn.close()
            return
        self.unauthenticated += 1
        try:
            async with asyncio.timeout(self.auth_timeout):
                chan = await accept_channel(conn, self.secret, self.limits)
        except (FrameError, TimeoutError, OSError) as e:
            self.stats.frames_rejected += 1
            log.warning("kv transfer: %s failed the handshake: %s", peer, e)
            conn.close()  # no key to sign a reply with: the peer learns nothing but the close
            return
        except asyncio.CancelledError:
            conn.close()
            raise
        finally:
            self.unauthenticated -= 1
        await self._frames(chan, peer)

    async def _frames(self, chan: Channel, peer: object) -> None:
        """Read frames back to back; handle up to `pipeline` of them concurrently, so receiving the next
        layer overlaps importing this one."""
        slots = asyncio.Semaphore(self.pipeline)
        inflight: set[asyncio.Task[None]] = set()
        try:
            while True:
                held = 0
                try:
                    try:
                        async with asyncio.timeout(self.idle_timeout):
                            hdr, seq = await chan.read_preamble()  # header tag checked before any body byte
                    except EOFError:
                        return  # clean close at a frame boundary
                    async with asyncio.timeout(self.frame_timeout):
                        body, (frame, meta) = None, await self._placed(chan, hdr, seq)
                        if frame is None:
                            await self.budget.acquire(hdr.body_len)
                            held = hdr.body_len
                            body = self.pool.take(hdr.body_len) if self.pool is not None else None
                            frame = await chan.read_body(hdr, seq, body, meta)
                except (FrameError, TimeoutError) as e:
                    if held:
                        self.budget.release(held)
                    await self._reject(chan, peer, e)
                    return
                self.stats.bytes_received += len(frame.payload) + len(frame.scales)
                await slots.acquire()
                t = asyncio.ensure_future(self._process(frame, chan))
                inflight.add(t)

                def done(t: asyncio.Task[None], n: int = held, body: memoryview | None = body) -> None:
                    inflight.discard(t)
                    slots.release()
                    self.budget.release(n)
                    if body is not None and self.pool is not None and not t.cancelled():
                        # the handler has returned: nothing reads these bytes any more (a cancelled one may
                        # have handed them to another thread still copying: those go to the GC instead)
                        self.pool.give(body)

                t.add_done_callback(done)
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            if inflight:  # let verified frames get their ACKs before the connection goes
                with contextlib.suppress(BaseException):
                    await asyncio.gather(*inflight, return_exceptions=True)
            with contextlib.suppress(BaseException):
                await chan.drain()  # their ACKs
            chan.close()

    async def _placed(self, chan: Channel, hdr: Header, seq: int) -> tuple[Frame | None, Buffer | None]:
        """A float LAYER frame whose request `place` has a destination for: its request id is read first (the
        header is authenticated already; the id is checked with the body's tags), then the payload straight
        into the destination. (None, the bytes already read): read the rest of the body into a buffer."""
        if self.place is None or hdr.kind != Kind.LAYER or hdr.scales_len:
            return None, None
        meta = await read_exact(chan.conn.recv_into, hdr.request_id_len)
        try:
            where = self.place(hdr, bytes(meta).decode("utf-8"))
        except UnicodeDecodeError:
            where = None  # the body's tag check rejects it
        if where is None:
            return None, meta
        return await read_placed(chan.conn, hdr, chan.keys.recv, seq, meta, where), None

    async def _reject(self, chan: Channel, peer: object, e: Exception) -> None:
        code = e.code if isinstance(e, FrameError) else ErrorCode.TRUNCATED
        self.stats.frames_rejected += 1
        log.warning("kv transfer: rejected frame from %s: %s", peer, e)
        # Framing (or trust) is lost after a bad frame: report once (signed) and drop this connection only.
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                await chan.send(ack("?", 0, code))

    async def _process(self, frame: Frame, chan: Channel) -> None:
        try:
            status = await self.handler(frame)
        except Exception:  # a bug in one transfer must not take the listener down
            log.exception("kv transfer: handler failed for %s layer %d", frame.request_id, frame.layer)
            status = ErrorCode.INTERNAL
        if frame.kind in (Kind.LAYER, Kind.STAGED):  # data frames are acknowledged; ABORT is not
            chan.queue(Frame(kind=Kind.ACK, request_id=frame.request_id, layer=frame.layer,
                             token_start=frame.token_start, token_end=frame.token_end, status=int(status)))
