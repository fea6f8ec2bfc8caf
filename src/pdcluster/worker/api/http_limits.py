"""How the worker and the router run uvicorn so slow or idle clients cannot hold connections forever.

uvicorn bounds only the wait *between* requests on a kept-alive connection; a client that opens a connection
and dribbles its request head (slowloris) is never timed out, and neither is one that sends nothing. Here:
the request head must be complete within `header_timeout` of its first byte (or of the connection's start),
the body within api.body's timeout (408), idle kept-alive connections close after `keep_alive` seconds, the
head is bounded in size, and beyond `limit_concurrency` open connections new requests get 503. A stop
(SIGTERM) is bounded too, even behind a blocked event loop (ExitBoundServer; `serve` runs both).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

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


# How long a stopping server's event loop may take to answer before it is taken as blocked, and how long a
# graceful shutdown may take beyond uvicorn's own timeout before the process exits anyway.
LOOP_ANSWER_S = 5.0
SHUTDOWN_SLACK_S = 5.0


class ExitBoundServer(uvicorn.Server):
    """uvicorn's server whose stop on SIGTERM / SIGINT is bounded: uvicorn only sets a flag its event loop
    polls, so a loop stuck in one long computation held the process ~85 s past SIGTERM. Here the signal also
    starts a watchdog thread: when the loop does not answer within `loop_answer_s` (it cannot drain anything
    then) the process exits at once; otherwise it gets uvicorn's graceful timeout plus `slack_s`."""

    loop_answer_s: float = LOOP_ANSWER_S
    slack_s: float = SHUTDOWN_SLACK_S

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.finished = threading.Event()
        self.exit: Callable[[int], None] = os._exit  # replaced in tests
        self._watchdog: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            await super().serve(sockets)
        finally:
            self.finished.set()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._watchdog is None and self._loop is not None:
            self._watchdog = threading.Thread(target=self.watch, args=(self._loop, sig), name="exit-watchdog",
                                              daemon=True)
            self._watchdog.start()

    def watch(self, loop: asyncio.AbstractEventLoop, sig: int) -> None:
        answered = threading.Event()
        try:
            loop.call_soon_threadsafe(answered.set)
        except RuntimeError:  # the loop is closed: shutdown is past the point of waiting for it
            return
        if not answered.wait(self.loop_answer_s):
            log.error("signal %d: the event loop has not answered for %.0f s; exiting without a graceful stop",
                      sig, self.loop_answer_s)
            self.exit(128 + sig)
            return
        grace = (self.config.timeout_graceful_shutdown or 0) + self.slack_s
        if not self.finished.wait(grace):
            log.error("signal %d: the graceful stop did not finish within %.0f s; exiting", sig, grace)
            self.exit(128 + sig)


def serve(app: Any, **kwargs: Any) -> None:
    """`uvicorn.run` with the bounded protocol options (uvicorn_options) and a bounded stop (ExitBoundServer)."""
    ExitBoundServer(uvicorn.Config(app, **{**uvicorn_options(), **kwargs})).run()
