"""Fault tests with real processes, on a `pdcluster up` cluster (router + 1 prefill + 2 decode workers, each
its own OS process): SIGKILL a decode worker mid-stream (the client's stream continues, token-identical) and
the prefill worker mid-request (requests complete or fail cleanly within the timeout). No KV blocks leak on
survivors (pdcluster_kv_cache_used_blocks back to 0), the launcher restarts both, later requests succeed,
and SIGTERM stops every process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from ..netutil import free_block
from .harness import AUTH, SECRET, metric

# The decode-kill tests: the tiny model's whole context (1,024 positions) less the prompt, so that the ~950
# decode steps still ahead at the client's third token dwarf the two signals that freeze the decode workers
KILL_DECODE_NEW = 980


def reference(model: Path, prompt: list[int], n: int) -> list[int]:
    from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine
    from pdcluster.worker.engine.sampling_params import SamplingParams

    e = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=256, num_threads=1))
    return e.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]


async def stream_tokens(url: str, prompt: list[int], n: int, on_progress: Any = None) -> tuple[list[int], list[str]]:
    ids: list[int] = []
    errors: list[str] = []
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    async with httpx.AsyncClient(timeout=150) as client, client.stream("POST", f"{url}/v1/completions",
                                                                       json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            if "error" in d:
                errors.append(d["error"]["message"])
                continue
            ids.extend(d["choices"][0].get("token_ids") or [])
            if on_progress is not None:
                await on_progress(len(ids))
    return ids, errors


class Up:
    """A `pdcluster up` child process and what it printed."""

    def __init__(self, model: Path, port: int, decode: int = 2) -> None:
        self.port = port
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("up_driver.py")), "--model", str(model), "--prefill", "1",
             "--decode", str(decode), "--port", str(port), "--disaggregation-threshold", "16"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            env={**os.environ, "PDCLUSTER_KV_SECRET": SECRET.decode()})  # so the test can read /internal/load
        self.lines: list[str] = []

    def wait_line(self, pattern: str, timeout: float) -> bool:
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line:
                self.lines.append(line)
                if re.search(pattern, line):
                    return True
            elif self.proc.poll() is not None:
                return False
            else:
                time.sleep(0.05)
        return False

    def pids(self) -> dict[str, int]:
        return {m.group(1): int(m.group(2)) for m in re.finditer(r"^\s+(\S+)\s+pid (\d+)", "".join(self.lines), re.M)}

    def kill(self) -> None:
        """After a failed test: `up` and every worker it printed, SIGKILL (which also ends a worker the test left
        SIGSTOPped: `up`'s own SIGTERM would wait until it is continued, and the worker outlive the test)."""
        if self.proc.poll() is None:
            for pid in self.pids().values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.kill()

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.port + i}"


def wait_all_healthy(router: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        snap = httpx.get(f"{router}/cluster", timeout=5).json()
        if all(w["healthy"] for w in snap["prefill"] + snap["decode"]) or time.monotonic() > deadline:
            return snap
        time.sleep(0.5)


def used_blocks_settle(urls: list[str], timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        used = [httpx.get(f"{u}/internal/load", headers=AUTH, timeout=5).json()["used_blocks"] for u in urls]
        if not any(used) or time.monotonic() > deadline:
            return used
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_workers_under_up(tiny_model_dir: Path) -> None:
    port = free_block(4)
    up = Up(tiny_model_dir, port)
    router, prefill, decodes = up.url(0), up.url(1), [up.url(2), up.url(3)]
    prompt = [(13 * i) % 900 + 5 for i in range(40)]
    want = reference(tiny_model_dir, prompt, KILL_DECODE_NEW)
    try:
        assert up.wait_line(r"^ready: ", 400), "".join(up.lines)
        pids = up.pids()
        assert set(pids) == {"prefill-0", "decode-0", "decode-1", "router"}, pids
        for name, role, p in (("prefill-0", "prefill", port + 1), ("decode-1", "decode", port + 3)):
            argv = open(f"/proc/{pids[name]}/cmdline").read().split("\0")
            assert argv[argv.index("--role") + 1] == role and argv[argv.index("--port") + 1] == str(p)
        killed: list[str] = []

        async def kill_decode_once(n: int) -> None:
            # Acts on the event the stream reports (its third token), with no poll that could miss it: freeze
            # both decode workers at once (SIGSTOP: no further token can be made), then ask the router which
            # one it is streaming the request from. Its accounting cannot change while they are frozen.
            if n >= 3 and not killed:
                for i in range(len(decodes)):
                    os.kill(pids[f"decode-{i}"], signal.SIGSTOP)
                snap = httpx.get(f"{router}/cluster", timeout=30).json()
                holding = [w["url"] for w in snap["decode"] if w["in_flight"] > 0]
                assert len(holding) == 1, snap  # frozen mid-request: the stream is still open on one worker
                for i, u in enumerate(decodes):
                    if u == holding[0]:
                        os.kill(pids[f"decode-{i}"], signal.SIGKILL)
                        killed.append(u)
                    else:
                        os.kill(pids[f"decode-{i}"], signal.SIGCONT)

        got, errs = asyncio.run(stream_tokens(router, prompt, KILL_DECODE_NEW, kill_decode_once))
        assert killed, "no decode worker was running the request"
        # one unbroken stream, token-identical to an uninterrupted greedy run
        assert errs == [] and got == want
        assert httpx.get(f"{router}/cluster").json()["router"]["resumes"] >= 1

        async def burst() -> list[tuple[list[int], list[str]]]:
            ps = [[(7 * i + j) % 900 + 5 for i in range(300)] for j in range(6)]
            tasks = [asyncio.ensure_future(stream_tokens(router, p, 8)) for p in ps]
            await asyncio.sleep(0.05)
            os.kill(pids["prefill-0"], signal.SIGKILL)
            return list(await asyncio.gather(*tasks))

        results = asyncio.run(burst())  # a request that hung would raise the client's read timeout here
        for ids, errs in results:
            # completed (retried elsewhere) or a clean error event, never a silently short answer
            assert (len(ids) == 8 and not errs) or errs, (ids, errs)
        survivor = next(u for u in decodes if u not in killed)
        assert used_blocks_settle([survivor]) == [0]
        assert metric(survivor, "pdcluster_kv_cache_used_blocks") == 0
        # the launcher restarts both killed workers; the router re-admits them
        assert up.wait_line(r"prefill-0 restarted", 120) or "prefill-0 restarted" in "".join(up.lines)
        snap = wait_all_healthy(router, 300)
        assert all(w["healthy"] for w in snap["prefill"] + snap["decode"]), snap

        async def later() -> list[tuple[list[int], list[str]]]:
            return list(await asyncio.gather(*(stream_tokens(router, [5 + j] * (10 + 9 * j), 6) for j in range(6))))

        assert all(len(ids) == 6 and not errs for ids, errs in asyncio.run(later()))
        assert used_blocks_settle([prefill, *decodes]) == [0, 0, 0]
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0
        restarted = [int(m) for m in re.findall(r"restarted \(pid (\d+)\)", "".join(up.lines))]
        for pid in [*up.pids().values(), *restarted]:
            assert not _alive(pid)
    finally:
        up.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_only_decode_worker_killed_mid_stream_resumes_on_its_restart(tiny_model_dir: Path) -> None:
    """Issue 15 item 1: with ONE decode worker, a stream whose decode worker is SIGKILLed resumes on the worker
    `up` restarts as soon as the router sees it healthy, token-identical; if the restart takes longer than the
    router's decode wait (30 s), the stream ends with a clear no-decode-worker error at that bound. It used to
    get no token until the request timed out."""
    port = free_block(3)
    up = Up(tiny_model_dir, port, decode=1)
    router = up.url(0)
    prompt = [(13 * i) % 900 + 5 for i in range(40)]
    want = reference(tiny_model_dir, prompt, KILL_DECODE_NEW)
    try:
        assert up.wait_line(r"^ready: ", 400), "".join(up.lines)
        pids = up.pids()
        arrivals: list[float] = []
        killed: list[float] = []

        async def kill_once(n: int) -> None:
            arrivals.append(time.monotonic())
            if n >= 3 and not killed:  # early: most of the tokens must still be ahead when it dies
                # frozen first, so the router's accounting shows the stream still open on it when it dies
                os.kill(pids["decode-0"], signal.SIGSTOP)
                snap = httpx.get(f"{router}/cluster", timeout=30).json()
                assert snap["decode"][0]["in_flight"] > 0, snap
                os.kill(pids["decode-0"], signal.SIGKILL)
                killed.append(time.monotonic())

        t0 = time.monotonic()
        got, errs = asyncio.run(stream_tokens(router, prompt, KILL_DECODE_NEW, kill_once))
        ended = time.monotonic()
        assert killed
        stall = max(b - a for a, b in zip(arrivals, arrivals[1:], strict=False)) if got == want else ended - killed[0]
        print(f"decode worker killed at {killed[0] - t0:.1f} s; longest gap / time to the error: {stall:.1f} s; "
              f"errors {errs}")
        # Either outcome is the router's own answer, not the client's 150 s timeout that the stream used to run
        # into; how long the restart takes depends on the machine's load, so the times are printed, not asserted.
        if errs:  # the restart took longer than the router's decode wait: a clear error, no silent stall
            assert len(errs) == 1 and "no healthy decode worker" in errs[0], errs
        else:  # resumed on the restarted worker: one unbroken stream, token-identical
            assert got == want, stall
            assert httpx.get(f"{router}/cluster").json()["router"]["resumes"] >= 1
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0
    finally:
        up.kill()
