"""An authenticated KV connection: the handshake (once), then frames in and out with their tags.

Both directions count their frames; a frame's tag is checked for the next expected position, so frames
cannot be replayed, reordered or dropped without the reader noticing. A reader takes 52 bytes (header and
its tag) before it knows a frame is genuine, then receives the body straight into one buffer of the
announced, already authenticated size.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from pdcluster.worker.transfer import handshake
from pdcluster.worker.transfer.frame import (
    DEFAULT_LIMITS,
    PREAMBLE_SIZE,
    TRAILER_SIZE,
    ErrorCode,
    Frame,
    FrameError,
    FrameKey,
    Header,
    Limits,
    parse_body,
    parse_placed,
    parse_preamble,
    seal_frame,
)
from pdcluster.worker.transfer.sockio import Buffer, Closed, Conn

# Status codes that a retry on the same receiver cannot fix.
FATAL = {ErrorCode.UNKNOWN_REQUEST, ErrorCode.SHAPE_MISMATCH, ErrorCode.UNAUTHENTICATED,
         ErrorCode.BAD_VERSION, ErrorCode.TOO_LARGE, ErrorCode.UNSUPPORTED}

FrameHandler = Callable[[Frame], Awaitable[ErrorCode]]
RecvInto = Callable[[memoryview], Awaitable[None]]


@dataclass
class Placement:
    """Where a data frame's payload is received in place (the receiver's cache), and how to undo the claim
    when its body fails: `abandon(fatal)`, fatal = the tag failed (what was written there is not the sender's)."""

    views: list[memoryview]
    abandon: Callable[[bool], None]
    alive: Callable[[], bool] = lambda: True  # checked before each receive into `views` (placing.py)
    done: Callable[[], None] = lambda: None  # the payload is in and its tags checked


# (authenticated header, request id as the body claims it) -> a Placement, or None for a pooled buffer
Place = Callable[[Header, str], Placement | None]


class TransferError(Exception):
    def __init__(self, message: str, code: ErrorCode = ErrorCode.INTERNAL) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class TransportStats:
    """Counters the worker exports as Prometheus metrics (read by the /internal routes)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    frames_rejected: int = 0
    failures: int = 0
    durations: list[float] = field(default_factory=list)  # seconds per completed send; drained by metrics


def new_buffer(n: int) -> bytearray | memoryview:
    """A writable buffer of n bytes. Big ones are not zero-filled (bytearray(n) memsets: at GB/s that is a
    pass over the memory for nothing, as the socket overwrites every byte)."""
    if n < 1 << 16:
        return bytearray(n)
    return np.empty(n, dtype=np.uint8).data.cast("B")  # ndarray.data: the array's memoryview, no copy


async def read_exact(recv_into: RecvInto, n: int) -> bytearray | memoryview:
    buf = new_buffer(n)
    try:
        await recv_into(memoryview(buf))
    except Closed as e:
        raise FrameError(ErrorCode.TRUNCATED, f"connection closed after {e.got} of {n} bytes") from None
    return buf


async def read_preamble(recv_into: RecvInto, key: FrameKey, seq: int, limits: Limits = DEFAULT_LIMITS) -> Header:
    """Header and its tag: validated and authenticated before the caller commits to a body."""
    return parse_preamble(await read_exact(recv_into, PREAMBLE_SIZE), key, seq, limits)


async def read_body(recv_into: RecvInto, hdr: Header, key: FrameKey, seq: int,
                    into: memoryview | None = None, prefix: Buffer | None = None) -> Frame:
    """The body, received in place into a buffer the frame then owns (its payload is a view of it): `into`
    (exactly hdr.body_len bytes, e.g. from a BufferPool), else a new one. `prefix`: its first bytes, already
    read from the connection."""
    into = memoryview(new_buffer(hdr.body_len)) if into is None else into
    if len(into) != hdr.body_len:
        raise ValueError(f"receive buffer of {len(into)} bytes for a body of {hdr.body_len}")
    done = 0
    if prefix is not None:
        done = len(prefix)
        into[:done] = prefix
    try:
        await recv_into(into[done:])
    except Closed as e:
        raise FrameError(ErrorCode.TRUNCATED, f"connection closed after {e.got} of {hdr.body_len} bytes") from None
    return parse_body(hdr, into, key, seq)


async def read_placed(conn: Conn, hdr: Header, key: FrameKey, seq: int, meta: Buffer, where: Placement) -> Frame:
    """The rest of a body whose `meta` (request id + scales) was read: the payload straight into `where`, then
    the tags, checked over exactly those bytes. On any failure the placement is abandoned before raising."""
    try:
        await conn.recv_into_parts(where.views, where.alive)
        tags = await read_exact(conn.recv_into, TRAILER_SIZE)
        frame = parse_placed(hdr, meta, where.views, tags, key, seq)
        where.done()
        return frame
    except Closed as e:
        where.abandon(False)
        raise FrameError(ErrorCode.TRUNCATED, f"connection closed after {e.got} bytes of a placed payload") from None
    except FrameError as e:
        where.abandon(e.code == ErrorCode.UNAUTHENTICATED)
        raise
    except BaseException:
        where.abandon(False)
        raise


async def read_frame(recv_into: RecvInto, key: FrameKey, seq: int, limits: Limits = DEFAULT_LIMITS) -> Frame:
    hdr = await read_preamble(recv_into, key, seq, limits)
    return await read_body(recv_into, hdr, key, seq)


class Channel:
    """One authenticated connection."""

    def __init__(self, conn: Conn, keys: handshake.Keys, limits: Limits = DEFAULT_LIMITS) -> None:
        self.conn, self.keys, self.limits = conn, keys, limits
        self.sent = 0  # frames written / read so far: the next frame's position, part of its tag's nonce
        self.received = 0
        self._lock = asyncio.Lock()
        self._queued: list[Frame] = []  # small frames (ACKs) written together by the next flush
        self._flush: asyncio.Task[None] | None = None

    async def send(self, frame: Frame) -> int:
        """Seal and write one frame (several tasks may send on one channel: positions stay in wire order)."""
        async with self._lock:
            parts = seal_frame(frame, self.keys.send, self.sent, self.limits)
            self.sent += 1
            return await self.conn.send(parts)

    def queue(self, frame: Frame) -> None:
        """Send a small frame soon, with the others queued in this turn of the loop: one `sendmsg` (one packet)
        for a burst of ACKs instead of one each (on loopback each small send also runs the peer's receive
        path in this thread). Each frame keeps its own position and tag; errors are dropped as a lost ACK."""
        self._queued.append(frame)
        if self._flush is None:
            self._flush = asyncio.get_running_loop().create_task(self.drain())

    async def drain(self) -> None:
        """Write every queued frame now (in order, sealed at their positions)."""
        async with self._lock:
            self._flush = None
            frames, self._queued = self._queued, []
            parts = []
            for f in frames:
                parts += seal_frame(f, self.keys.send, self.sent, self.limits)
                self.sent += 1
            try:
                await self.conn.send(parts)
            except OSError:
                pass  # the connection is gone: the sender resends what it has no ACK for

    async def read_preamble(self) -> tuple[Header, int]:
        """Raises EOFError when the peer closed cleanly at a frame boundary, FrameError otherwise."""
        seq = self.received
        buf = bytearray(PREAMBLE_SIZE)
        try:
            await self.conn.recv_into(memoryview(buf))
        except Closed as e:
            if e.got == 0:
                raise EOFError("peer closed the connection") from None
            raise FrameError(ErrorCode.TRUNCATED, f"header cut after {e.got} bytes") from None
        hdr = parse_preamble(buf, self.keys.recv, seq, self.limits)
        self.received += 1
        return hdr, seq

    async def read_body(self, hdr: Header, seq: int, into: memoryview | None = None,
                        prefix: Buffer | None = None) -> Frame:
        return await read_body(self.conn.recv_into, hdr, self.keys.recv, seq, into, prefix)

    async def read_frame(self) -> Frame:
        hdr, seq = await self.read_preamble()
        return await self.read_body(hdr, seq)

    def close(self) -> None:
        self.conn.close()


async def open_channel(host: str, port: int, secret: bytes, limits: Limits = DEFAULT_LIMITS) -> Channel:
    """Connect and authenticate both ends. Raises OSError (no route, refused), FrameError(UNAUTHENTICATED)
    when the peer cannot prove it holds the secret, FrameError(TRUNCATED) when it hangs up mid-handshake."""
    conn = await Conn.connect(host, port)
    try:
        nc = handshake.new_nonce()
        await conn.send([handshake.hello(nc)])
        ns = handshake.check_server_proof(secret, nc, await read_exact(conn.recv_into, handshake.SERVER_PROOF.size))
        await conn.send([handshake.client_proof(secret, nc, ns)])
        return Channel(conn, handshake.keys(secret, nc, ns, server=False), limits)
    except BaseException:
        conn.close()
        raise


async def accept_channel(conn: Conn, secret: bytes, limits: Limits = DEFAULT_LIMITS) -> Channel:
    """Server side of the handshake: 37 + 32 bytes read from an unauthenticated peer, nothing more."""
    nc = handshake.parse_hello(await read_exact(conn.recv_into, handshake.HELLO.size))
    ns = handshake.new_nonce()
    await conn.send([handshake.server_proof(secret, nc, ns)])
    handshake.check_client_proof(secret, nc, ns, await read_exact(conn.recv_into, handshake.CLIENT_PROOF_SIZE))
    return Channel(conn, handshake.keys(secret, nc, ns, server=True), limits)
