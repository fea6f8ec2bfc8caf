"""Issue 38 row 12: SIGTERM waited ~85 s behind a blocked event loop (uvicorn only sets a flag the loop polls).
ExitBoundServer's watchdog exits at once when the loop does not answer, and lets a loop that answers have its
graceful stop. The exit call is recorded instead of ending the test process; a loop that "does not answer" is one
that is not running, so no outcome depends on timing."""

from __future__ import annotations

import asyncio
import signal
import threading

import uvicorn

from pdcluster.worker.api.http_limits import ExitBoundServer


def server(exits: list[int]) -> ExitBoundServer:
    s = ExitBoundServer(uvicorn.Config(app=None, timeout_graceful_shutdown=1))  # type: ignore[arg-type]
    s.loop_answer_s, s.slack_s = 0.2, 0.2
    s.exit = exits.append
    return s


def test_a_loop_that_does_not_answer_exits_without_waiting_for_a_graceful_stop() -> None:
    exits: list[int] = []
    blocked = asyncio.new_event_loop()  # never run: like a loop stuck in one long computation
    try:
        server(exits).watch(blocked, signal.SIGTERM)
    finally:
        blocked.close()
    assert exits == [128 + signal.SIGTERM]


def test_a_loop_that_answers_gets_its_graceful_stop() -> None:
    exits: list[int] = []
    s = server(exits)
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        s.finished.set()  # the graceful stop completed
        s.watch(loop, signal.SIGTERM)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        loop.close()
    assert exits == []


def test_a_graceful_stop_that_never_finishes_is_cut_off() -> None:
    exits: list[int] = []
    s = server(exits)
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        s.watch(loop, signal.SIGTERM)  # `finished` is never set: a connection that never drains
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        loop.close()
    assert exits == [128 + signal.SIGTERM]
