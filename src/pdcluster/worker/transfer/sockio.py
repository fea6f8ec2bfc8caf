"""Zero-copy socket I/O on the event loop: receive straight into the destination buffer (`recv_into`), send
a frame's parts with one scatter-gather `sendmsg` (no join of header and payload, no stream buffer).

asyncio's streams copy every byte at least once on each side (the StreamReader's buffer, then the
caller's); at GB/s that copy is the cost, so the KV transport talks to its sockets through this instead.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Sequence

Buffer = bytes | bytearray | memoryview
SOCK_BUF = 4 * 1024 * 1024  # kernel buffers: a 4 MiB window keeps loopback and LAN links full


def consume(views: list[memoryview], n: int) -> None:
    """Drop the first `n` bytes from `views` in place (what one `sendmsg`/`recvmsg_into` took of them)."""
    while n:
        if n >= len(views[0]):
            n -= len(views.pop(0))
        else:
            views[0], n = views[0][n:], 0


class Closed(ConnectionError):
    """The peer closed the connection; `got` bytes of the current read had arrived."""

    def __init__(self, got: int) -> None:
        super().__init__(f"connection closed after {got} bytes")
        self.got = got


class Conn:
    """A connected non-blocking TCP socket."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        opts = [(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF), (socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)]
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            opts.append((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1))  # ACKs and small frames go at once
        for level, opt, value in opts:
            try:
                sock.setsockopt(level, opt, value)
            except OSError:  # a tuning, not a requirement
                pass
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self._send_lock = asyncio.Lock()  # frames from several tasks never interleave on the wire

    @classmethod
    async def connect(cls, host: str, port: int) -> Conn:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, type_, proto, _, addr = infos[0]
        sock = socket.socket(family, type_, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, addr)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    def peer(self) -> object:
        try:
            return self.sock.getpeername()
        except OSError:
            return None

    async def recv_into(self, view: memoryview) -> None:
        """Fill `view` exactly. Raises Closed."""
        got, n = 0, len(view)
        while got < n:
            k = await self.loop.sock_recv_into(self.sock, view[got:])
            if k == 0:
                raise Closed(got)
            got += k

    async def recv_into_parts(self, views: Sequence[memoryview], alive: Callable[[], bool] = lambda: True) -> None:
        """Fill every view, in order (scatter-gather `recvmsg_into`: a payload lands in its destination's
        pieces, e.g. cache blocks, with as few syscalls as the kernel allows). Raises Closed, also as soon as
        `alive()` says the views may no longer be written (checked before every receive)."""
        todo = [v for v in views if len(v)]
        got = 0
        while todo:
            if not alive():
                raise Closed(got)
            try:
                k = self.sock.recvmsg_into(todo[:512])[0]  # IOV_MAX is 1024 on Linux
            except (BlockingIOError, InterruptedError):
                await self._ready(self.loop.add_reader, self.loop.remove_reader)
                continue
            if k == 0:
                raise Closed(got)
            got += k
            consume(todo, k)

    async def recv_exactly(self, n: int) -> bytearray:
        buf = bytearray(n)
        await self.recv_into(memoryview(buf))
        return buf

    async def at_eof(self) -> bool:
        """Wait for the peer to send a byte or close; True when it closed (nothing more will come)."""
        return await self.loop.sock_recv(self.sock, 1) == b""

    async def send(self, parts: Sequence[Buffer]) -> int:
        """Write every part, in order, with as few syscalls as the kernel allows (sendmsg scatter-gather).
        Returns the bytes written."""
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        total = sum(len(v) for v in views)
        async with self._send_lock:
            while views:
                try:
                    sent = self.sock.sendmsg(views[:512])  # IOV_MAX is 1024 on Linux
                except (BlockingIOError, InterruptedError):
                    await self._ready(self.loop.add_writer, self.loop.remove_writer)
                    continue
                consume(views, sent)
        return total

    async def _ready(self, add: Callable[..., None], remove: Callable[[int], object]) -> None:
        """Wait until the socket is writable (add_writer) or readable (add_reader)."""
        fut = self.loop.create_future()
        fd = self.sock.fileno()

        def wake() -> None:
            if not fut.done():  # the callback may fire again before it is removed
                fut.set_result(None)

        add(fd, wake)
        try:
            await fut
        finally:
            remove(fd)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
