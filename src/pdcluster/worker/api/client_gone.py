"""Work done for a client that stops when the client goes: a request whose client disconnects while its
body is prepared (tokenized, its grammar compiled) or its result gathered is cancelled at once, so a grammar
compile still queued for it never runs and the engine aborts what it was generating."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from pdcluster.worker.api import errors

T = TypeVar("T")


async def until_disconnected(request: Request) -> None:
    # After the body is read, the next ASGI message is http.disconnect when the client leaves.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or 499 when the client disconnects first (`work` is cancelled then)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise errors.APIError(499, "client disconnected", code="client_closed")
    return task.result()
