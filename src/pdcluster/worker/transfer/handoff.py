"""Frames built off the event loop (the engine's thread, an encoder thread) handed to it as futures: `done`
wraps frames already built (or the error building them) so that one code path on the loop takes both."""

from __future__ import annotations

import asyncio
import concurrent.futures

from pdcluster.worker.transfer.frame import Frame
from pdcluster.worker.transfer.outbox import Outbox


def on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def done(frames: list[tuple[Outbox, Frame]] | None = None,
         error: BaseException | None = None) -> concurrent.futures.Future[list[tuple[Outbox, Frame]]]:
    fut: concurrent.futures.Future[list[tuple[Outbox, Frame]]] = concurrent.futures.Future()
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(frames or [])
    return fut
