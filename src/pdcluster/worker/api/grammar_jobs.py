"""Where structured-output grammars compile, and how long a request may wait for one.

A grammar compile is CPU work that grows fast with the schema (a 500-deep `items` chain took seconds on a
1k vocabulary) and cannot be interrupted once started. So compiles run on their own small pool, never on the
default executor that tokenizes every plain request; at most `max_queued` wait for it (past that: 429, the
compiler is busy); a compile that has not started when its request goes away (client left, deadline) is
cancelled; and a request waits at most `budget_s` for its compile once it runs (past that: 400 naming the field,
the schema is too complex). A compile that outlives its request finishes in the background and is cached
(engine/structured.py), so it is never paid twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pdcluster.worker.api import errors

THREADS = 1  # compiles use several threads each inside xgrammar already; one at a time keeps the cores shared
MAX_QUEUED = 8
BUDGET_S = 10.0


class GrammarJobs:
    def __init__(self, threads: int = THREADS, max_queued: int = MAX_QUEUED, budget_s: float = BUDGET_S) -> None:
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self.max_queued, self.budget_s = max_queued, budget_s
        self.queued = 0  # submitted and not started
        self.running = 0
        self._lock = threading.Lock()

    async def run(self, compile_one: Callable[[Any], None], arg: Any, param: str) -> None:
        """`compile_one(arg)` on the pool; ValueError from it becomes a 400 naming `param`."""
        if self.queued >= self.max_queued:
            raise errors.APIError(429, "the structured-output compiler is busy; retry later", code="grammar_busy",
                                  headers={"Retry-After": "1"})
        loop = asyncio.get_running_loop()
        started = asyncio.Event()
        mine = {"started": False, "abandoned": False}

        def job() -> None:
            with self._lock:  # a job whose request went away before it started is never run
                if mine["abandoned"]:
                    return
                mine["started"] = True
                self.queued -= 1
                self.running += 1
            loop.call_soon_threadsafe(started.set)
            try:
                compile_one(arg)
            finally:
                with self._lock:
                    self.running -= 1

        with self._lock:
            self.queued += 1
        fut: asyncio.Future[Any] = loop.run_in_executor(self.pool, job)
        fut.add_done_callback(_consume)  # a result nobody waits for any more (timeout) is not an error to log
        try:
            start: asyncio.Future[Any] = asyncio.ensure_future(started.wait())
            try:
                await asyncio.wait({start, fut}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                start.cancel()
            done, _ = await asyncio.wait({fut}, timeout=self.budget_s)
        except asyncio.CancelledError:
            with self._lock:
                if not mine["started"]:
                    mine["abandoned"] = True
                    self.queued -= 1
            fut.cancel()  # not started: it never runs; running: it finishes and is cached
            raise
        if not done:
            raise errors.bad_request(f"{param}: too complex: its grammar did not compile within {self.budget_s:g} s; "
                                     "simplify the schema", param=param, code="grammar_too_complex")
        try:
            fut.result()
        except ValueError as e:
            raise errors.bad_request(f"{param}: {e}", param=param) from None


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        with contextlib.suppress(BaseException):
            fut.result()


JOBS = GrammarJobs()  # the process's compile pool (one engine per worker process)
