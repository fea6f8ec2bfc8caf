"""The supervisor behind `pdcluster up`: restart with backoff, clean stop. (`up` itself, with real
processes, SIGKILLs and restarts, is exercised end to end in test_faults.py.)"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from pdcluster.worker.local.supervisor import Supervisor, backoff


def test_backoff_grows_and_caps() -> None:
    assert [backoff(n) for n in (1, 2, 3, 4, 5, 9)] == [1, 2, 4, 8, 10, 10]


def test_supervisor_restarts_a_dead_child_and_stops_all(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path)
    p = sup.add("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
    first = p.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 30
    events: list[str] = []
    while p.pid == first and time.monotonic() < deadline:
        events += sup.poll()
        time.sleep(0.05)
    assert p.pid != first and p.alive and p.restarts == 1
    assert any("exited" in e for e in events) and any("restarted" in e for e in events)
    sup.stop(timeout=5)
    assert not p.alive
