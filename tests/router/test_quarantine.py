"""A prefill->decode pair whose KV transfers keep failing is kept apart for a while (router/quarantine.py),
never leaving a request without a decode worker."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from pdcluster.worker.router.quarantine import PairQuarantine

from .fakes import DECODE, DECODE2, PREFILL, Script, make_flow, ndjson, tokens
from .test_flow_failover import DONE, FIRST, PROMPT, collect, ids, resume_from, streamed


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_threshold_window_and_hold():
    c = Clock()
    q = PairQuarantine(threshold=2, window_s=60.0, hold_s=30.0, clock=c)
    assert not q.failed("p", "d")
    c.t = 61.0  # the first failure left the window: this is the first again
    assert not q.failed("p", "d") and q.blocked("p") == set()
    c.t = 70.0
    assert q.failed("p", "d") and q.blocked("p") == {"d"} and q.active() == [("p", "d")]
    assert q.blocked("other-prefill") == set() and q.quarantines == 1
    c.t = 100.0  # hold over
    assert q.blocked("p") == set() and q.active() == []
    with pytest.raises(ValueError):
        PairQuarantine(threshold=0)


def reserve_port(port: int) -> Any:
    async def h(_: httpx.Request, __: dict[str, Any]) -> httpx.Response:
        return httpx.Response(200, json={"transfer_port": port})
    return h


def prefill_failing_to(port: int, times: int | None = None) -> Any:
    """/internal/prefill whose transfer to the decode worker on `port` fails (the first `times` times)."""
    left = [times]

    async def h(_: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        if body["target"]["port"] == port and (left[0] is None or left[0] > 0):
            if left[0] is not None:
                left[0] -= 1
            return httpx.Response(200, content=ndjson(FIRST, {"event": "error", "stage": "transfer",
                                                              "message": "kv load timed out"}))
        return httpx.Response(200, content=ndjson(FIRST, DONE))
    return h


async def test_a_failing_pair_is_skipped_for_the_next_requests() -> None:
    s = Script()
    for d, port in ((DECODE, 9), (DECODE2, 19)):
        s.on(d, "/internal/reserve", reserve_port(port))
        s.on(d, "/internal/generate", resume_from(len(PROMPT), 12))
        s.on(d, "/internal/decode", streamed(tokens(11, 2)))
    s.on(PREFILL, "/internal/prefill", prefill_failing_to(9))
    flow = make_flow(s, decode=(DECODE, DECODE2))
    for _ in range(2):  # the transfer to DECODE fails; the request resumes on DECODE2
        assert ids(await collect(flow, 3)) == [10, 11, 12]
    assert s.paths(DECODE).count("/internal/reserve") == 2  # DECODE was the first choice both times
    assert flow.quarantine.active() == [(PREFILL, DECODE)] and flow.retries == 2
    assert ids(await collect(flow, 3)) == [10, 11, 12]
    # the third request went to DECODE2 at once: no reservation on DECODE, no failed transfer, no retry
    assert s.paths(DECODE).count("/internal/reserve") == 2 and flow.retries == 2
    assert s.paths(DECODE2).count("/internal/decode") == 1


async def test_a_quarantine_never_leaves_a_request_without_a_decode_worker() -> None:
    s = Script()
    s.on(DECODE, "/internal/reserve", reserve_port(9))
    s.on(DECODE, "/internal/generate", resume_from(len(PROMPT), 12))
    s.on(DECODE, "/internal/decode", streamed(tokens(11, 2)))
    s.on(PREFILL, "/internal/prefill", prefill_failing_to(9, times=2))
    flow = make_flow(s, decode=(DECODE,))
    for _ in range(2):
        assert ids(await collect(flow, 3)) == [10, 11, 12]
    assert flow.quarantine.active() == [(PREFILL, DECODE)]
    # the only decode worker: the pair is in quarantine, and still used (the transfer now works)
    assert ids(await collect(flow, 3)) == [10, 11, 12]
    assert s.paths(DECODE).count("/internal/reserve") == 3 and s.paths(DECODE).count("/internal/decode") == 1
