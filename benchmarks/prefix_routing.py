"""Prefix-cache-aware routing vs least-loaded picking on a real trace with shared prefixes (issue 14 §3).

Two `pdcluster up` stacks run side by side, identical but for `--routing prefix` / `--routing least-loaded`.
The trace slice (Mooncake by default: its `hash_ids` become really shared prompt prefixes, as in
`pdcluster bench --trace`) is cut into consecutive windows, and each window is replayed open-loop against one
stack and then the other, the order alternating (ABBA...), so both see the same requests in the same order
under the same machine load. Measured per stack: the workers' prefix-cache hit rate (their own
`pdcluster_prefix_cache_{hit,query}_tokens` counters, prefill workers and all workers), the router's
expected-hit tokens, and TTFT/TPOT percentiles as the client sees them.

    python -m benchmarks.prefix_routing --out DIR [--trace FILE] [--duration S] [--speedup X] ...

Writes DIR/summary.json, prints a markdown table, and leaves the per-request results (requests.jsonl) and
the stacks' logs in a scratch folder it names.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx

from pdcluster.bench import loadgen
from pdcluster.bench import trace as tr
from pdcluster.bench.replay import prompt_ids
from pdcluster.bench.stats import RequestResult, percentile
from pdcluster.worker.api import cli_args as types

POLICIES = ("prefix", "least-loaded")
TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"
SHAPE = {"ids": True, "ext": True}  # token-id prompts, ignore_eos: exact lengths on both stacks


# ---- pure ---------------------------------------------------------------------------------------------

def windows(trace: tr.Trace, n: int) -> list[tr.Trace]:
    """`n` consecutive slices of equal duration, each re-based to start at 0 (empty slices dropped)."""
    if n < 1:
        raise ValueError("--windows must be >= 1")
    span = trace.duration_s / n or 1.0
    out = []
    for k in range(n):
        lo, hi = k * span, (k + 1) * span
        kept = [r for r in trace.requests if lo <= r.t < hi or (k == n - 1 and r.t >= lo)]
        if kept:
            out.append(replace(trace, requests=tuple(replace(r, t=r.t - lo) for r in kept)))
    return out


def shrink(trace: tr.Trace, divisor: float, max_model_len: int) -> tr.Trace:
    """Every length (and the prefix block) divided by `divisor`, prompts then clipped to fit `max_model_len`.

    Unlike `trace.scale_lengths` (one factor set by the longest request, here 1/60: 512-token prefix blocks
    would shrink below one KV block and nothing could be shared), the factor is chosen so a prefix block is
    still a whole number of KV blocks; the few prompts then too long keep their leading blocks (the shared
    part) and lose their tail."""
    if not divisor >= 1:
        raise ValueError(f"--length-divisor must be >= 1 (got {divisor})")
    if max_model_len < 2:
        raise ValueError(f"--max-model-len must be >= 2 (got {max_model_len})")

    def one(r: tr.Request) -> tr.Request:
        o = min(max(1, round(r.output_tokens / divisor)), max_model_len // 2)
        return replace(r, input_tokens=min(max(1, round(r.input_tokens / divisor)), max_model_len - o),
                       output_tokens=o)

    return replace(trace, requests=tuple(one(r) for r in trace.requests),
                   block_tokens=max(1, round(trace.block_tokens / divisor)))


def prefix_counters(metrics_text: str) -> tuple[float, float]:
    """(query tokens, hit tokens) summed over a worker's /metrics exposition."""
    q = h = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("pdcluster_prefix_cache_query_tokens_total"):
            q += float(line.rsplit(" ", 1)[1])
        elif line.startswith("pdcluster_prefix_cache_hit_tokens_total"):
            h += float(line.rsplit(" ", 1)[1])
    return q, h


def summarize(results: list[RequestResult], counters: dict[str, list[float]], router: dict) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [t for r in ok if (t := r.tpot) is not None]
    pq, ph, aq, ah = counters["prefill"][0], counters["prefill"][1], counters["all"][0], counters["all"][1]
    return {"requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
            "prefill_hit_rate": ph / pq if pq else None, "all_hit_rate": ah / aq if aq else None,
            "prefill_query_tokens": pq, "prefill_hit_tokens": ph, "all_query_tokens": aq, "all_hit_tokens": ah,
            "router_expected_tokens": router.get("prefix_expected_tokens"),
            "router_routed_tokens": router.get("prefix_routed_tokens"),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
            "ttft_p99_s": percentile(ttft, 99), "ttft_mean_s": sum(ttft) / len(ttft) if ttft else None,
            "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99)}


# ---- I/O ----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def stack(policy: str, port: int, args: argparse.Namespace, log: Path, env: dict[str, str]) -> Iterator[str]:
    """One `pdcluster up --routing POLICY`; yields the router URL once every worker is healthy behind it."""
    cmd = [sys.executable, "-m", "pdcluster", "up", "--port", str(port), "--host", "127.0.0.1",
           "--routing", policy, "--prefill", str(args.prefill), "--decode", str(args.decode),
           "--threads", str(args.threads), "--block-size", str(args.block_size),
           "--max-queue-depth", "0", "--request-timeout", str(args.timeout)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                view = httpx.get(f"{url}/cluster", timeout=2).json()
                if sum(w["healthy"] for role in ("prefill", "decode") for w in view[role]) == args.prefill + args.decode:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pdcluster up --routing {policy} did not come up; see {log}")
            time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # `up` stops its router and workers
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def scrape(url: str) -> tuple[dict[str, list[float]], dict]:
    """Prefix counters of every worker behind the router (prefill pool, and all), and the router's view."""
    view = httpx.get(f"{url}/cluster", timeout=5).json()
    out = {"prefill": [0.0, 0.0], "all": [0.0, 0.0]}
    for role in ("prefill", "decode"):
        for w in view[role]:
            q, h = prefix_counters(httpx.get(f"{w['url']}/metrics", timeout=5).text)
            for key in ("all", role) if role == "prefill" else ("all",):
                out[key][0] += q
                out[key][1] += h
    return out, view.get("router", {})


async def replay(url: str, window: tr.Trace, payloads: list[dict], timeout: float) -> list[RequestResult]:
    """Open loop: each request leaves at its offset whether or not earlier ones have answered."""
    curl = loadgen.completions_url(url)
    async with loadgen.make_client(512, timeout) as client:
        t0 = time.perf_counter()
        tasks = []
        for r, p in zip(window.requests, payloads, strict=True):
            delay = t0 + r.t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(loadgen.stream_one(client, curl, p, timeout)))
        return list(await asyncio.gather(*tasks))


def build_payloads(window: tr.Trace, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for r in window.requests:
        p = loadgen.build_payload(1, max(1, r.output_tokens), rng, SHAPE)
        p["prompt"] = prompt_ids(r, window.block_tokens, rng)
        out.append(p)
    return out


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run(args: argparse.Namespace) -> dict:
    trace = tr.read_trace(args.trace)
    trace = tr.time_window(trace, args.start, args.start + args.duration)
    trace = tr.scale_time(shrink(trace, args.length_divisor, args.max_model_len), args.speedup)
    parts = windows(trace, args.windows)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    raw = Path(tempfile.mkdtemp(prefix="pdcluster-prefix-routing-"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PDCLUSTER_KV_SECRET": secrets.token_hex(32)}
    results: dict[str, list[RequestResult]] = {p: [] for p in POLICIES}
    loads = [load_avg()]
    with stack(POLICIES[0], args.port, args, raw / "up-prefix.log", env) as a, \
            stack(POLICIES[1], args.port + 20, args, raw / "up-least-loaded.log", env) as b:
        urls = dict(zip(POLICIES, (a, b), strict=True))
        warm = tr.Trace(tuple(tr.Request(0.2 * i, 100, 2) for i in range(6)), "synthetic", "warm-up")
        for url in urls.values():  # first (slow) steps of every worker, uncounted, unrelated prompts
            asyncio.run(replay(url, warm, build_payloads(warm, 99), args.timeout))
        base = {p: scrape(u)[0] for p, u in urls.items()}
        for k, w in enumerate(parts):
            payloads = build_payloads(w, args.seed + k)  # the same prompts for both stacks
            for policy in POLICIES if k % 2 == 0 else POLICIES[::-1]:
                got = asyncio.run(replay(urls[policy], w, payloads, args.timeout))
                results[policy] += got
                print(f"window {k + 1}/{len(parts)} {policy}: {len(w.requests)} requests, "
                      f"{sum(r.ok for r in got)} ok, load {load_avg()}", file=sys.stderr, flush=True)
                loads.append(load_avg())
        final = {p: scrape(u) for p, u in urls.items()}
    policies = {}
    for p in POLICIES:
        counters = {k: [final[p][0][k][i] - base[p][k][i] for i in (0, 1)] for k in ("prefill", "all")}
        policies[p] = summarize(results[p], counters, final[p][1])
    print(f"per-request results and logs: {raw}", file=sys.stderr)
    with (raw / "requests.jsonl").open("w") as f:
        for p in POLICIES:
            for r in results[p]:
                f.write(json.dumps({"policy": p, **r.to_json()}) + "\n")
    summary = {"trace": tr.summarize(trace), "conditions": {
        "trace_file": str(args.trace), "start_s": args.start, "duration_s": args.duration,
        "speedup": args.speedup, "length_divisor": args.length_divisor, "max_model_len": args.max_model_len, "block_tokens": trace.block_tokens,
        "windows": len(parts), "prefill": args.prefill, "decode": args.decode, "threads": args.threads,
        "block_size": args.block_size, "cpus": os.cpu_count(), "load_avg_1_5_15": loads},
        "policies": policies}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def table(summary: dict) -> str:
    def f(v: float | None, pct: bool = False) -> str:
        return "-" if v is None else (f"{100 * v:.1f}%" if pct else f"{v:.3f}")
    rows = ["| routing | ok/requests | prefill hit rate | all-worker hit rate | TTFT p50 s | TTFT p99 s | "
            "TPOT p50 s |", "|---|---|---|---|---|---|---|"]
    for p, s in summary["policies"].items():
        rows.append(f"| {p} | {s['ok']}/{s['requests']} | {f(s['prefill_hit_rate'], True)} | "
                    f"{f(s['all_hit_rate'], True)} | {f(s['ttft_p50_s'])} | {f(s['ttft_p99_s'])} | "
                    f"{f(s['tpot_p50_s'])} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefix_routing", description=__doc__.split("\n")[0])
    p.add_argument("--trace", type=Path, default=TRACE, help="Mooncake JSONL (hash_ids) trace")
    p.add_argument("--start", type=types.non_negative_float, default=0.0, help="trace seconds to skip")
    p.add_argument("--duration", type=types.positive_float, default=240.0, help="trace seconds to replay")
    p.add_argument("--speedup", type=types.positive_float, default=1.0, help="replay X times faster than the trace")
    p.add_argument("--length-divisor", type=types.between(1, 4096), default=64.0,
                   help="divide prompt/output lengths and the 512-token prefix block by this (64: 8-token blocks)")
    p.add_argument("--max-model-len", type=types.positive_int, default=2048, help="prompts clipped so prompt + output fit")
    p.add_argument("--windows", type=types.positive_int, default=4, help="interleaved slices (ABBA order)")
    p.add_argument("--prefill", type=types.positive_int, default=2, help="prefill workers per stack")
    p.add_argument("--decode", type=types.positive_int, default=1, help="decode workers per stack")
    p.add_argument("--threads", type=types.positive_int, default=1, help="torch threads per worker")
    p.add_argument("--block-size", type=int, choices=[8, 16, 32], default=8,
                   help="KV block tokens (8: one block per shrunk prefix block)")
    p.add_argument("--port", type=types.port, default=18400, help="first stack's router; the second's is +20")
    p.add_argument("--timeout", type=types.positive_float, default=120.0, help="per request, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        summary = run(args)
    except (ValueError, RuntimeError) as e:  # TraceError is a ValueError
        print(f"prefix_routing: {e}", file=sys.stderr)
        return 2
    print(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
