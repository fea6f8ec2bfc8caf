"""api/grammar_jobs.py (issue 38 row 2): grammar compiles run on their own pool, never where plain requests are
tokenized; a request waits a bounded time for its compile once it runs; a compile still queued when its
client goes is never run; a full queue is a 429. The compiles here are callables that block on an event the
test controls, so nothing depends on how fast anything runs."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from pdcluster.worker.api.errors import APIError
from pdcluster.worker.api.grammar_jobs import GrammarJobs


class Blocking:
    """A compile that runs until released; records which specs ran."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.ran: list[Any] = []
        self.entered = threading.Event()

    def __call__(self, spec: Any) -> None:
        self.ran.append(spec)
        self.entered.set()
        if not self.release.wait(30):
            raise AssertionError("never released")
        if spec == "bad":
            raise ValueError("minLength 5 is greater than maxLength 2")


async def entered(b: Blocking) -> None:
    await asyncio.to_thread(b.entered.wait, 30)


async def test_plain_work_on_the_default_executor_never_waits_behind_a_compile() -> None:
    jobs, b = GrammarJobs(threads=1), Blocking()
    compile_task = asyncio.ensure_future(jobs.run(b, "slow", "guided_json"))
    await entered(b)
    # the tokenizer's pool (asyncio.to_thread) answers while the compile holds the grammar pool
    assert await asyncio.to_thread(lambda: "tokenized") == "tokenized"
    assert not compile_task.done()
    b.release.set()
    await compile_task


async def test_a_compile_over_its_budget_is_400_naming_the_field() -> None:
    jobs, b = GrammarJobs(threads=1, budget_s=0.05), Blocking()
    with pytest.raises(APIError) as e:
        await jobs.run(b, "slow", "response_format")
    assert e.value.status == 400 and e.value.param == "response_format" and e.value.code == "grammar_too_complex"
    b.release.set()


async def test_a_bad_spec_is_400_naming_the_field() -> None:
    jobs, b = GrammarJobs(threads=1), Blocking()
    b.release.set()
    with pytest.raises(APIError) as e:
        await jobs.run(b, "bad", "guided_json")
    assert e.value.status == 400 and e.value.param == "guided_json" and "maxLength" in e.value.message


async def test_a_queued_compile_whose_client_left_never_runs() -> None:
    jobs, b = GrammarJobs(threads=1), Blocking()
    first = asyncio.ensure_future(jobs.run(b, "first", "guided_json"))
    await entered(b)
    queued = asyncio.ensure_future(jobs.run(b, "left", "guided_json"))
    await asyncio.sleep(0)  # submitted: behind "first" on the one thread
    queued.cancel()  # the client went away (api/client_gone.py cancels the request's preparation)
    with pytest.raises(asyncio.CancelledError):
        await queued
    b.release.set()
    await first
    await asyncio.get_running_loop().run_in_executor(jobs.pool, lambda: None)  # the pool has drained
    assert b.ran == ["first"] and jobs.queued == 0


async def test_a_full_queue_is_429() -> None:
    jobs, b = GrammarJobs(threads=1, max_queued=2), Blocking()
    running = asyncio.ensure_future(jobs.run(b, "running", "guided_json"))
    await entered(b)
    waiting = [asyncio.ensure_future(jobs.run(b, f"q{i}", "guided_json")) for i in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(APIError) as e:
        await jobs.run(b, "one too many", "guided_json")
    assert e.value.status == 429 and e.value.code == "grammar_busy"
    b.release.set()
    await asyncio.gather(running, *waiting)
