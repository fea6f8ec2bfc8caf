"""`pdcluster up`: separate processes with --role/--port, a SIGKILLed worker is restarted, SIGTERM stops
everything; and the supervisor's restart/backoff logic on its own."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from pdcluster.worker.supervisor import Supervisor, backoff

from .harness import free_port


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


def _wait_line(proc: subprocess.Popen[str], pattern: str, timeout: float, seen: list[str]) -> re.Match[str] | None:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                return None
            continue
        seen.append(line)
        m = re.search(pattern, line)
        if m:
            return m
    return None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_up_runs_restarts_and_shuts_down(tiny_model_dir: Path) -> None:
    port = free_port()
    while any(_busy(port + i) for i in range(1, 3)):
        port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("up_driver.py")), "--model", str(tiny_model_dir),
         "--prefill", "1", "--decode", "1", "--port", str(port), "--disaggregation-threshold", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    seen: list[str] = []
    try:
        assert _wait_line(proc, r"^ready: ", 400, seen), "".join(seen)
        pids = {m.group(1): int(m.group(2)) for m in re.finditer(r"^\s+(\S+)\s+pid (\d+)", "".join(seen), re.M)}
        assert set(pids) == {"prefill-0", "decode-0", "router"}
        cmdlines = {n: open(f"/proc/{pid}/cmdline").read().split("\0") for n, pid in pids.items()}
        assert "--role" in cmdlines["prefill-0"] and "prefill" in cmdlines["prefill-0"]
        assert "--port" in cmdlines["decode-0"] and str(port + 2) in cmdlines["decode-0"]
        router = f"http://127.0.0.1:{port}"
        body = {"prompt": [11] * 20, "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{router}/v1/completions", json=body, timeout=60).status_code == 200
        os.kill(pids["decode-0"], signal.SIGKILL)
        assert _wait_line(proc, r"decode-0 restarted", 120, seen), "".join(seen)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            d = httpx.get(f"{router}/cluster", timeout=5).json()["decode"][0]
            if d["healthy"]:
                break
            time.sleep(0.5)
        assert httpx.post(f"{router}/v1/completions", json=body, timeout=60).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        for pid in pids.values():
            assert not _alive(pid)
    finally:
        if proc.poll() is None:
            proc.kill()


def _busy(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"
