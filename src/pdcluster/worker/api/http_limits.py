"""How the worker and the router run uvicorn so slow or idle clients cannot hold connections forever.

uvicorn bounds only the wait *between* requests on a kept-alive connection; a client that opens a connection
and dribbles its request head (slowloris) is never timed out, and neither is one that sends nothing. Here:
the request head must be complete within `header_timeout` of its first byte (or of the connection's start),
the body within api.body's timeout (408), idle kept-alive connections close after `keep_alive` seconds, the
head is bounded in size, and beyond `limit_concurrency` open connections new requests get 503.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0  # a real client sends its whole request head at once
KEEP_ALIVE_S = 5  # uvicorn's default, stated
# Below the usual 1024 open-file limit, which the router also needs for one worker connection per stream.
LIMIT_CONCURRENCY = 480
MAX_HEAD_BYTES = 16 * 1024  # h11's default bound on an incomplete request head, stated


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a deadline on reading each request head."""

    header_timeout: float = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()  # a connection that never sends a byte is cut off too

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # IDLE: h11 is still waiting for (the rest of) a request head, on a new or kept-alive connection.
        if self.conn.their_state is h11.IDLE:
            self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def uvicorn_options(*, limit_concurrency: int = LIMIT_CONCURRENCY, header_timeout: float = HEADER_TIMEOUT_S,
                    keep_alive: int = KEEP_ALIVE_S) -> dict[str, Any]:
    """Keyword arguments for `uvicorn.run` / `uvicorn.Config`."""
    protocol = type("BoundedH11Protocol", (BoundedH11Protocol,), {"header_timeout": header_timeout})
    return {"http": protocol, "limit_concurrency": limit_concurrency, "timeout_keep_alive": keep_alive,
            "h11_max_incomplete_event_size": MAX_HEAD_BYTES}
