"""The served event loop's thread policy: SCHED_BATCH for the caller only, and inherited by its new threads."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from pdcluster.worker.engine.thread_policy import yield_on_wakeup

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux scheduling policies")


def _in_thread(fn):  # type: ignore[no-untyped-def]
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_demotes_only_the_calling_thread_and_what_it_starts_later() -> None:
    def body() -> tuple[bool, int, int]:
        ok = yield_on_wakeup()
        child = _in_thread(lambda: os.sched_getscheduler(0))  # created after: inherits the policy
        return ok, os.sched_getscheduler(0), child

    ok, mine, child = _in_thread(body)
    assert ok and mine == os.SCHED_BATCH and child == os.SCHED_BATCH
    assert os.sched_getscheduler(0) != os.SCHED_BATCH  # the test's own thread is untouched


def test_refusal_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> None:
        raise PermissionError("seccomp")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    assert yield_on_wakeup() is False
