"""`pdcluster bench --trace FILE [--speedup X] [--max-model-len N] [--start S --duration S]`: open-loop replay.

Each trace request is sent at its (time-scaled) offset whether or not earlier ones have answered, with a
token-id prompt of the trace's length and `max_tokens` = its output length (lengths shrunk by one factor
when `--max-model-len` is smaller than the longest request). Mooncake `hash_ids` become real shared
prefixes: block id h is always the same `block_tokens` token ids, so two requests sharing leading hash
ids share those prompt tokens and a prefix cache can reuse their KV.

Writes to --out: requests.jsonl (one line per request: trace offset, lengths, outcome, TTFT, TPOT),
summary.json (trace summary + outcome counts and TTFT/TPOT percentiles) and prints the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

from pdcluster.bench import loadgen
from pdcluster.bench import trace as tr
from pdcluster.bench.stats import RequestResult, percentile
from pdcluster.worker.api import cli_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, default=None,
                   help="replay this trace (Azure CSV or Mooncake JSONL) open-loop instead of a grid sweep")
    p.add_argument("--speedup", type=cli_args.positive_float, default=1.0, help="with --trace: replay X times faster")
    p.add_argument("--max-model-len", type=cli_args.positive_int, default=None,
                   help="with --trace: shrink lengths by one factor so the longest request fits")
    p.add_argument("--max-output-tokens", type=cli_args.positive_int, default=None,
                   help="with --trace and --max-model-len: keep output lengths (clipped to this) and shrink "
                        "prompts alone to fit")
    p.add_argument("--start", type=cli_args.non_negative_float, default=0.0, help="with --trace: skip the first S seconds")
    p.add_argument("--duration", type=cli_args.positive_float, default=None, help="with --trace: replay only D seconds")


def block_tokens(h: int, n: int, lo: int, hi: int) -> list[int]:
    """The token ids of prefix block `h`: the same for every request that names it."""
    rng = random.Random(h * 1_000_003 + 7)
    return [rng.randrange(lo, hi) for _ in range(n)]


def prompt_ids(req: tr.Request, block: int, rng: random.Random, lo: int = 5, hi: int = 250) -> list[int]:
    n = max(1, req.input_tokens)
    ids: list[int] = []
    for h in req.hash_ids or ():
        if len(ids) >= n:
            break
        ids += block_tokens(h, block, lo, hi)
    ids = ids[:n]
    ids += [rng.randrange(lo, hi) for _ in range(n - len(ids))]  # the request's own (unshared) tail
    return ids


def load(args: argparse.Namespace) -> tr.Trace:
    if not args.speedup > 0:
        raise ValueError(f"--speedup must be > 0 (got {args.speedup})")
    t = tr.read_trace(args.trace)
    if args.start or args.duration is not None:
        t = tr.time_window(t, args.start, None if args.duration is None else args.start + args.duration)
    if getattr(args, "max_output_tokens", None) and args.max_model_len is None:
        raise ValueError("--max-output-tokens needs --max-model-len (the prompts are shrunk to fit it)")
    if args.max_model_len is not None and getattr(args, "max_output_tokens", None):
        t = tr.fit_prompts(t, args.max_model_len, args.max_output_tokens)
    elif args.max_model_len is not None:
        t = tr.scale_lengths(t, args.max_model_len)
    return tr.scale_time(t, args.speedup)


async def replay(args: argparse.Namespace, trace: tr.Trace, out: Path) -> tuple[list[RequestResult], dict]:
    url = loadgen.completions_url(args.url)
    results: list[RequestResult | None] = [None] * len(trace.requests)
    async with loadgen.make_client(256, args.timeout) as client:
        model = args.model or await loadgen.discover_model(client, url)
        probe = await loadgen.probe_shape(client, url, model, min(args.timeout, 60.0))
        if probe.shape is None:
            raise ConnectionError(f"{args.url} is not serving completions "
                                  f"({probe.result.error}: {probe.result.detail})")
        rng = random.Random(args.seed)
        hi = max(6, args.token_id_max)
        payloads = []
        for r in trace.requests:
            p = loadgen.build_payload(1, max(1, r.output_tokens), rng, probe.shape, model)
            p["prompt"] = (prompt_ids(r, trace.block_tokens, rng, 5, hi) if probe.shape["ids"]
                           else loadgen.make_prompt_text(max(1, r.input_tokens), rng))
            payloads.append(p)

        async def one(i: int) -> None:
            results[i] = await loadgen.stream_one(client, url, payloads[i], args.timeout)

        t0 = time.perf_counter()
        tasks = []
        for i, r in enumerate(trace.requests):
            delay = t0 + r.t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))  # open loop: never wait for replies here
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    done = [r if r is not None else RequestResult(ok=False, error="not_sent") for r in results]
    with (out / "requests.jsonl").open("w") as f:
        for req, res in zip(trace.requests, done, strict=True):
            f.write(json.dumps({"t": req.t, "input_tokens": req.input_tokens,
                                "output_tokens": req.output_tokens, **res.to_json()}) + "\n")
    return done, {"wall_s": wall, "model": model, "request_shape": probe.shape}


def summarize_results(results: list[RequestResult]) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [t for r in ok if (t := r.tpot) is not None]
    return {"requests": len(results), "ok": len(ok),
            "errors": dict(Counter(r.error for r in results if not r.ok)),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99)}


def run(args: argparse.Namespace) -> int:
    try:
        loadgen.completions_url(args.url)
        trace = load(args)
    except ValueError as e:  # TraceError is a ValueError
        print(f"pdcluster bench: {e}", file=sys.stderr)
        return 2
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    s = tr.summarize(trace)
    print(f"replaying {s['requests']} requests over {s['duration_s']:.0f}s (x{args.speedup:g}) "
          f"against {args.url}", file=sys.stderr)
    try:
        results, meta = asyncio.run(replay(args, trace, out))
    except ConnectionError as e:
        print(f"pdcluster bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    summary = {"trace": s, "speedup": args.speedup, **meta, **summarize_results(results)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("requests", "ok", "errors", "ttft_p50_s", "ttft_p99_s",
                                              "tpot_p50_s", "tpot_p99_s", "wall_s")}, indent=1))
    return 0 if summary["ok"] else 1
