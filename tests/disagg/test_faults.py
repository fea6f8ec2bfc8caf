"""Fault tests with real worker processes: SIGKILL a decode worker mid-stream and a prefill worker
mid-request. Requests complete (or fail cleanly) within the timeout, survivors leak no KV blocks
(pdcluster_kv_cache_used_blocks back to 0), and later requests all succeed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .harness import SECRET, Cluster, free_port, metric, serve

HERE = Path(__file__).parent
MAX_NEW = 160


@contextlib.contextmanager
def process_cluster(model: Path, n_prefill: int = 1, n_decode: int = 2,
                    request_timeout: float = 60.0) -> Iterator[tuple[Cluster, dict[str, subprocess.Popen[bytes]]]]:
    from pdcluster.worker.router.app import RouterState, build_router_app
    from pdcluster.worker.router.pool import Pool

    env = {**os.environ, "PDCLUSTER_KV_SECRET": SECRET.decode()}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    c = Cluster(router="")
    try:
        for role, n, bs in (("prefill", n_prefill, 8), ("decode", n_decode, 16)):
            for _ in range(n):
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                procs[url] = subprocess.Popen([sys.executable, str(HERE / "worker_proc.py"), "--model", str(model),
                                               "--role", role, "--port", str(port), "--block-size", str(bs),
                                               "--threads", "1"], env=env)
                (c.prefill if role == "prefill" else c.decode).append(url)
        deadline = time.monotonic() + 300  # a loaded 2-core box needs ~30 s per worker
        for url in procs:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                assert time.monotonic() < deadline, f"{url} did not start"
                time.sleep(0.2)
        pool = Pool(prefill_urls=c.prefill, decode_urls=c.decode, interval=0.2)
        c.state = RouterState(pool, max_queue_depth=None, threshold=16, request_timeout=request_timeout,
                              max_retries=3)
        with serve(build_router_app(c.state)) as router:
            c.router = router
            yield c, procs
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def used_blocks_settle(urls: list[str], timeout: float = 30.0) -> list[float]:
    """pdcluster_kv_cache_used_blocks of each worker once idle (polled: release is asynchronous)."""
    deadline = time.monotonic() + timeout
    while True:
        used = [httpx.get(f"{u}/internal/load", timeout=5).json()["used_blocks"] for u in urls]
        if not any(used) or time.monotonic() > deadline:
            return used
        time.sleep(0.1)


def reference(model: Path, prompt: list[int], n: int) -> list[int]:
    from pdcluster.worker.engine import EngineConfig, LLMEngine
    from pdcluster.worker.sampling_params import SamplingParams

    e = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=256, num_threads=1))
    return e.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]


async def stream_tokens(url: str, prompt: list[int], n: int, on_progress=None) -> tuple[list[int], list[str]]:  # type: ignore[no-untyped-def]
    ids: list[int] = []
    errors: list[str] = []
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    async with httpx.AsyncClient(timeout=90) as client, client.stream("POST", f"{url}/v1/completions",
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


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_decode_mid_stream_resumes_and_prefill_death_is_survived(tiny_model_dir: Path) -> None:
    prompt = [(13 * i) % 900 + 5 for i in range(40)]  # >= threshold 16: disaggregated
    want = reference(tiny_model_dir, prompt, MAX_NEW)
    with process_cluster(tiny_model_dir) as (c, procs):
        killed: list[str] = []

        async def kill_decode_once(n: int) -> None:
            if n >= 20 and not killed:
                # the decode worker holding the request is the one with a running sequence
                for u in c.decode:
                    if httpx.get(f"{u}/internal/load", timeout=5).json()["running"] > 0:
                        procs[u].send_signal(signal.SIGKILL)
                        killed.append(u)
                        return

        got, errs = asyncio.run(stream_tokens(c.router, prompt, MAX_NEW, kill_decode_once))
        assert killed, "no decode worker was running the request"
        # one unbroken stream: every token, in order, equal to the monolithic engine's (greedy resume)
        assert errs == [] and got == want
        assert c.state.flow.resumes >= 1

        # SIGKILL the (only) prefill worker while a burst of long-prompt requests is in flight: the router
        # retries them on the decode pool, which prefills for itself when no prefill worker is left.
        async def burst() -> list[tuple[list[int], list[str]]]:
            ps = [[(7 * i + j) % 900 + 5 for i in range(300)] for j in range(6)]
            tasks = [asyncio.ensure_future(stream_tokens(c.router, p, 8)) for p in ps]
            await asyncio.sleep(0.05)
            victim = c.prefill[0]
            procs[victim].send_signal(signal.SIGKILL)
            killed.append(victim)
            return list(await asyncio.gather(*tasks))

        t0 = time.monotonic()
        results = asyncio.run(burst())
        assert time.monotonic() - t0 < 90  # bounded by the request timeout, never a hang
        for ids, errs in results:
            # complete (retried on the surviving prefill worker) or a clean error event; nothing partial
            assert (len(ids) == 8 and not errs) or (errs and not ids), (ids, errs)
        survivors = [u for u in c.prefill + c.decode if u not in killed]
        assert used_blocks_settle(survivors) == [0] * len(survivors)
        assert all(metric(u, "pdcluster_kv_cache_used_blocks") == 0 for u in survivors)
        # later requests all succeed on the survivors
        async def later_requests() -> list[tuple[list[int], list[str]]]:
            return list(await asyncio.gather(*(stream_tokens(c.router, [5 + j] * (10 + 9 * j), 6) for j in range(6))))

        later = asyncio.run(later_requests())
        assert all(len(ids) == 6 and not errs for ids, errs in later)
        snap = httpx.get(f"{c.router}/cluster").json()
        dead = {w["url"]: w["healthy"] for w in snap["prefill"] + snap["decode"] if w["url"] in killed}
        assert dead and not any(dead.values())
