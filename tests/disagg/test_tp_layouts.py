"""Prefill and decode at different tensor-parallel layouts, end to end with real processes: `pdcluster serve
--role prefill --tensor-parallel-size a`, `--role decode --tensor-parallel-size b`, `pdcluster router`, KV
over TCP. Greedy output through the router equals a TP 1 engine's (what a single `serve` returns), every
request's KV really crossed the wire (transfer bytes, no failure, no fallback), and no block stays used.
A follower rank of the decode worker killed mid-stream: the request errors, nothing hangs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ..netutil import free_block, free_port
from .harness import AUTH, SECRET, metric
from .test_equality import run_all

pytestmark = pytest.mark.slow
MAX_NEW = 8
LENGTHS = [1, 7, 8, 9, 17, 33, 64]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdcluster.worker.local.demo_model import build_demo_model  # 4 heads over 2 KV heads, a tokenizer

    return build_demo_model(tmp_path_factory.mktemp("tp-layouts"), num_hidden_layers=2, max_position_embeddings=256)


def prompts() -> list[list[int]]:
    return [[(37 * n + 11 * i) % 200 + 3 for i in range(n)] for n in LENGTHS]


def reference(model: Path, ps: list[list[int]]) -> list[list[int]]:
    from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine
    from pdcluster.worker.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=256, num_threads=1))
    return engine.generate(ps, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))


# Bounds on waits for a state that, once reached, stays (a worker healthy, a worker failed, blocks released):
# each only catches a hang, so it is generous enough for a loaded machine (`make test` runs on every core).
SETTLE_S = 240.0
HANG_S = 180.0  # an HTTP read that waits this long is a hang


def _until(check: Callable[[], object], what: str, seconds: float = SETTLE_S) -> object:
    """``check()``'s first truthy value; a state that persists once reached, so no poll can miss it."""
    deadline = time.monotonic() + seconds
    while True:
        with contextlib.suppress(httpx.HTTPError):
            got = check()
            if got:
                return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {seconds:.0f} s")
        time.sleep(0.2)


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds the loopback listening socket on ``port``. A port picked free can be bound by
    another process before ours binds it (a concurrent test's worker, under xdist): its /health would answer for
    ours, and the router would then be given one worker as both prefill and decode."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port and f[9] in inodes:  # 0A: LISTEN
            return True
    return False


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    def ready() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:]
        return httpx.get(f"{url}/health", timeout=10).status_code == 200 and _listens(proc.pid, int(url.rsplit(":", 1)[1]))

    _until(ready, f"{url} healthy ({log})")


@contextlib.contextmanager
def tp_cluster(model: Path, tmp: Path, prefill_tp: int, decode_tp: int, backend: str = "tcp",
               compression: str = "none", path: str = "direct",
               env: dict[str, dict[str, str]] | None = None) -> Iterator[dict[str, object]]:
    """Both workers run `--kv-transfer-tp-path path`; ``env`` adds variables to one role's process. Rank r of
    a worker listens on its KV port + r, so the port is the start of a free block below the ephemeral range
    (a TP 4 worker's ranks 1-3 once met ports in use there, and the worker fell back to the relay)."""
    secret = tmp / "secret"
    secret.write_bytes(SECRET)
    procs: list[subprocess.Popen[bytes]] = []
    urls: dict[str, str] = {}
    try:
        for role, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
            port, log = free_port(), tmp / f"{role}.log"
            cmd = [sys.executable, "-m", "pdcluster", "serve", "--model", str(model), "--port", str(port),
                   "--role", role, "--served-model-name", "tiny", "--kv-cache-memory", "4Mi", "--threads", "1",
                   "--log-level", "warning", "--tensor-parallel-size", str(tp), "--kv-transfer-backend", backend, "--kv-transfer-compression", compression,
                   "--kv-transfer-secret-file", str(secret), "--kv-transfer-port", str(free_block(tp)),
                   "--kv-transfer-timeout", "10", "--kv-transfer-tp-path", path]
            procs.append(subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                          env={**os.environ, **(env or {}).get(role, {})}))
            urls[role] = f"http://127.0.0.1:{port}"
        for proc, role in zip(procs, ("prefill", "decode"), strict=True):
            _wait_healthy(urls[role], proc, tmp / f"{role}.log")
        port, log = free_port(), tmp / "router.log"
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "pdcluster", "router", "--prefill", urls["prefill"], "--decode", urls["decode"],
             "--port", str(port), "--disaggregation-threshold", "0", "--max-retries", "0",
             "--internal-secret-file", str(secret), "--health-interval", "0.2", "--log-level", "warning"],
            stdout=log.open("wb"), stderr=subprocess.STDOUT))
        urls["router"] = f"http://127.0.0.1:{port}"
        _wait_healthy(urls["router"], procs[-1], log)
        # the router's pools see both workers healthy (else a request would run on decode alone)
        _until(lambda: all(w.get("healthy") for pool in ("prefill", "decode")
                           for w in httpx.get(f"{urls['router']}/cluster", timeout=10).json()[pool]),
               "the router sees both workers healthy")
        yield {"urls": urls, "procs": procs}
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_int8_wire_tp2_to_tp2_equals_tp1_pair(model: Path, tmp_path: Path) -> None:
    """int8 on the wire (per-vector codes, so the same codes whatever the layout): TP 2 -> TP 2 gives the
    tokens of a TP 1 -> TP 1 pair with int8 on the wire (in-process harness cluster)."""
    from .harness import cluster

    ps = prompts()
    with cluster(model, prefill_blocks=(16,), decode_blocks=(16,), compression="int8") as c1:
        want = asyncio.run(run_all(c1.router, ps, stream=True))
    with tp_cluster(model, tmp_path, 2, 2, compression="int8") as c:
        urls = c["urls"]
        assert isinstance(urls, dict)
        assert asyncio.run(run_all(urls["router"], ps, stream=True)) == want
        assert metric(urls["decode"], "pdcluster_kv_transfer_bytes_total") > 0
        assert metric(urls["decode"], "pdcluster_kv_transfer_failures_total") == 0


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _loads(urls: dict[str, str], roles: tuple[str, ...] = ("prefill", "decode")) -> list[dict[str, Any]]:
    return [httpx.get(f"{urls[r]}/internal/load", headers=AUTH, timeout=10).json() for r in roles]


def _idle(urls: dict[str, str], roles: tuple[str, ...] = ("prefill", "decode")) -> list[dict[str, Any]]:
    """The workers' loads once nothing is held: a block kept for a transfer or a reservation comes back when
    the transfer ends, the router's cancel arrives, or at the latest the decode worker's reaper frees it
    (twice the transfer timeout), all well inside the bound; a leak stays and fails the caller's assert."""
    def idle() -> bool:
        return all(d["used_blocks"] == 0 and d["pending_loads"] == 0 and d["in_flight"] == 0
                   for d in _loads(urls, roles))

    with contextlib.suppress(AssertionError):
        _until(idle, "workers idle")
    return _loads(urls, roles)


def _nixl() -> str | None:
    from pdcluster.worker.transfer.nixl_agent import availability

    a = availability()
    return None if a.ok else a.reason


NIXL = pytest.mark.skipif(_nixl() is not None, reason=str(_nixl()))


@pytest.mark.parametrize("prefill_tp,decode_tp,backend,path", [
    (2, 1, "tcp", "direct"), (1, 2, "tcp", "direct"), (2, 4, "tcp", "direct"),
    pytest.param(2, 1, "nixl", "direct", marks=NIXL), pytest.param(1, 2, "nixl", "direct", marks=NIXL),
    (2, 1, "tcp", "relay"), pytest.param(1, 2, "nixl", "relay", marks=NIXL)])
def test_greedy_through_router_equals_tp1(model: Path, tmp_path: Path, prefill_tp: int, decode_tp: int,
                                          backend: str, path: str) -> None:
    """Direct (each rank its own endpoint, the default) or relayed through rank 0: the same tokens as TP 1,
    and the KV went the way the log says: per-rank bytes as the re-sharding plan says, no byte over the
    ranks' gloo group on the direct path, every byte over it (some) on the relay path."""
    from pdcluster.worker.transfer import reshard

    ps = prompts()
    want = reference(model, ps)
    with tp_cluster(model, tmp_path, prefill_tp, decode_tp, backend, path=path) as c:
        urls = c["urls"]
        assert isinstance(urls, dict)
        for role in ("prefill", "decode"):
            load = httpx.get(f"{urls[role]}/internal/load", headers=AUTH, timeout=5).json()
            assert load["transfer_backend"] == backend, load
            assert load["kv_direct"] is (path == "direct"), load
        got = asyncio.run(run_all(urls["router"], ps, stream=True))
        assert got == want
        for role in ("prefill", "decode"):
            assert metric(urls[role], "pdcluster_kv_transfer_failures_total") == 0
        assert metric(urls["prefill"], "pdcluster_kv_transfer_bytes_total") > 0  # the KV crossed the wire
        assert metric(urls["decode"], "pdcluster_kv_transfer_bytes_total") > 0
        loads = _idle(urls)
        assert all(d["used_blocks"] == 0 and d["pending_loads"] == 0 for d in loads), loads
        p, d = loads
        relayed = sum(p["kv_relay_bytes"].values()) + sum(d["kv_relay_bytes"].values())
        if path == "relay":
            assert relayed > 0, (p, d)
            return
        assert relayed == 0, (p, d)  # no KV byte crossed a gloo hop
        plan = reshard.plan(2, prefill_tp, decode_tp)  # the demo model's 2 KV heads
        sent, received = p["kv_rank_bytes"]["sent"], d["kv_rank_bytes"]["received"]
        assert [b > 0 for b in sent] == [bool(reshard.sends(plan, r)) for r in range(prefill_tp)], sent
        assert all(b > 0 for b in received) and len(received) == decode_tp, received
        assert sum(sent) >= sum(received)  # frames (headers, MACs) on top of the payload
        assert_ranks_clean(urls)


def assert_ranks_clean(urls: dict[str, str], skip_dead: bool = False) -> None:
    """Every live rank of both workers: no pending load, no send in progress, nothing held in NIXL."""
    for role in ("prefill", "decode"):
        ranks = httpx.get(f"{urls[role]}/internal/load?ranks=1", headers=AUTH, timeout=15).json()["kv_ranks"]
        for r in ranks:
            if r.get("dead") and skip_dead:
                continue
            assert not r.get("dead") and r["pending_loads"] == 0 and r["saving"] == 0, (role, r)
            reg = r.get("registrations")
            if reg:
                assert (reg["staging_regions"], reg["staging_used_bytes"], reg["outgoing"]) == (0, 0, 0), (role, r)


def test_decode_rank_killed_mid_stream_errors_the_request(model: Path, tmp_path: Path) -> None:
    """Decode at TP 2 loses its follower while requests decode: each ends with an error (no hang), the
    decode worker reports itself unhealthy, and the prefill worker is left with nothing held."""
    with tp_cluster(model, tmp_path, 2, 2) as c:
        urls, procs = c["urls"], c["procs"]
        assert isinstance(urls, dict) and isinstance(procs, list)
        follower = _children(procs[1].pid)
        assert len(follower) == 1
        body = {"model": "tiny", "prompt": prompts()[-1], "max_tokens": 150, "temperature": 0, "ignore_eos": True,
                "stream": True}
        lines: list[str] = []
        with httpx.stream("POST", f"{urls['router']}/v1/completions", json=body, timeout=HANG_S) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 6:  # a few tokens decoded on both ranks
                    os.kill(follower[0], signal.SIGKILL)
        assert len(lines) > 6 and any("error" in ln for ln in lines[6:]), lines
        assert httpx.get(f"{urls['decode']}/health", timeout=10).status_code == 503  # set before the error went out
        p = _idle(urls, ("prefill",))[0]
        assert p["used_blocks"] == 0 and p["in_flight"] == 0, p


def test_prefill_rank_killed_nothing_hangs_or_leaks(model: Path, tmp_path: Path) -> None:
    """Prefill at TP 2 loses its follower. A request sent at once meets the worker before or after it notices:
    it ends (an error, or the router's fallback to prefilling on the decode worker), never hangs. Once the
    prefill worker reports itself failed, the router drops it from its pool (its /internal/load says not
    ready: before, the router kept it and retried its 503 "busy" answers until the client gave up) and the
    next request runs on the decode worker with the TP 1 tokens. The decode worker holds no block and no
    pending load afterwards."""
    ps = [prompts()[-1]]
    want = reference(model, ps)
    with tp_cluster(model, tmp_path, 2, 1) as c:
        urls, procs = c["urls"], c["procs"]
        assert isinstance(urls, dict) and isinstance(procs, list)
        follower = _children(procs[0].pid)
        assert len(follower) == 1
        os.kill(follower[0], signal.SIGKILL)
        body = {"model": "tiny", "prompt": ps[0], "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        r = httpx.post(f"{urls['router']}/v1/completions", json=body, timeout=HANG_S)
        assert r.status_code in (200, 500, 502, 503), r.text
        # the failure is for good: the worker's health says so from the moment its watcher saw the rank exit
        _until(lambda: httpx.get(f"{urls['prefill']}/health", timeout=10).status_code == 503, "prefill failed")
        load = _loads(urls, ("prefill",))[0]
        assert load["ready"] is False and "tensor-parallel" in load["error"], load  # the rank exit or the failed step
        r = httpx.post(f"{urls['router']}/v1/completions", json=body, timeout=HANG_S)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want[0]
        d = _idle(urls, ("decode",))[0]
        assert d["used_blocks"] == 0 and d["pending_loads"] == 0, d
