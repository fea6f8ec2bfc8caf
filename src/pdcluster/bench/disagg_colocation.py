"""Colocated vs disaggregated on this machine: the seed's core claim, measured.

    python -m pdcluster.bench.disagg_colocation [--model DIR] [--json OUT] [--threshold 128]

Same router, same mixed workload (a few long prompts arriving among many short ones, streamed), two
layouts on the same CPU budget:
  colocated      one `both` worker with 2 torch threads (prefill and decode share one batch loop)
  disaggregated  1 prefill worker + 1 decode worker, 1 thread each (long prompts prefill on the prefill
                 worker and their KV moves over loopback; prompts under --threshold prefill on the decode
                 worker)
P50/P99 TTFT and TPOT as the client sees them, side by side. Whatever way it comes out is the result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from pdcluster.worker.local.workload import Req, fmt_ms, mixed, run


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(model: Path, role: str, port: int, threads: int, log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "pdcluster.bench.disagg_worker", "--model", str(model), "--role", role,
           "--port", str(port), "--threads", str(threads), "--max-batch-size", "32"]
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)


def _wait(urls: list[str], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    for u in urls:
        while True:
            try:
                if httpx.get(f"{u}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{u} did not become ready")
            time.sleep(0.3)


def layout(name: str, model: Path, reqs: list[Req], threshold: int, logdir: Path) -> dict[str, Any]:
    env = {**os.environ, "PDCLUSTER_KV_SECRET": secrets.token_hex(16)}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        if name == "colocated":
            w = _port()
            procs.append(_worker(model, "both", w, 2, logdir / "both.log", env))
            pre, dec, thr = [], [f"http://127.0.0.1:{w}"], 1 << 30
        else:
            p, d = _port(), _port()
            procs.append(_worker(model, "prefill", p, 1, logdir / "prefill.log", env))
            procs.append(_worker(model, "decode", d, 1, logdir / "decode.log", env))
            pre, dec, thr = [f"http://127.0.0.1:{p}"], [f"http://127.0.0.1:{d}"], threshold
        r = _port()
        cmd = [sys.executable, "-m", "pdcluster", "router", "--port", str(r), "--decode", *dec,
               "--disaggregation-threshold", str(thr), "--max-queue-depth", "0", "--log-level", "warning",
               "--health-interval", "0.5"]
        if pre:
            cmd += ["--prefill", *pre]
        procs.append(subprocess.Popen(cmd, stdout=(logdir / "router.log").open("ab"), stderr=subprocess.STDOUT, env=env))
        router = f"http://127.0.0.1:{r}"
        _wait([*pre, *dec, router])
        asyncio.run(run(router, [Req(600, 2, 0.0), Req(20, 8, 0.0)]))  # warm-up (allocations, first batches)
        summary, results = asyncio.run(run(router, reqs))
        return {"layout": name, **summary.to_dict()}
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the `pdcluster up` demo model (built if missing)")
    ap.add_argument("--threshold", type=int, default=128, help="disaggregation threshold of the disaggregated run")
    ap.add_argument("--short", type=int, default=48)
    ap.add_argument("--long", type=int, default=6)
    ap.add_argument("--long-len", type=int, default=1536)
    ap.add_argument("--rate", type=float, default=4.0, help="requests/s (Poisson)")
    ap.add_argument("--repeat", type=int, default=1, help="alternate the layouts this many times (drift, noise)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.model:
        model = Path(a.model)
    else:
        from pdcluster.worker.local.launcher import cache_dir, ensure_demo_model

        model = ensure_demo_model(cache_dir(None))
    reqs = mixed(n_short=a.short, n_long=a.long, long_len=a.long_len, short_out=48, long_out=16, rate=a.rate)
    logdir = Path(tempfile.mkdtemp(prefix="disagg-bench-"))
    rows = [{"run": i, **layout(name, model, reqs, a.threshold, logdir)}
            for i in range(a.repeat) for name in ("colocated", "disaggregated")]
    print(f"workload: {a.short} short (16-48 tok, 48 out) + {a.long} long ({a.long_len} tok, 16 out) at "
          f"{a.rate}/s; model {model}; logs {logdir}")
    print(f"{'run':>3} {'layout':<14} {'ok':>5} {'TTFT p50':>10} {'TTFT p99':>10} {'TPOT p50':>10} {'TPOT p99':>10} {'tok/s':>7}")
    for r in rows:
        print(f"{r['run']:>3} {r['layout']:<14} {r['ok']:>2}/{r['requests']:<2} {fmt_ms(r['ttft_p50']):>10} "
              f"{fmt_ms(r['ttft_p99']):>10} {fmt_ms(r['tpot_p50']):>10} {fmt_ms(r['tpot_p99']):>10} "
              f"{r['throughput_tok_s']:>7.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"workload": vars(a), "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
