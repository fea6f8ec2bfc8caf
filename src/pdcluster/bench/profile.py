"""`pdcluster profile`: a worker's prefill capacity (prompt tok/s at saturation) and decode capacity
(output tok/s) across decode batch sizes, the knee, and the `spec.autoscaling.capacity` block.

Two ways to measure:
- `--url`: over HTTP against a running worker that can serve whole requests (`--role both`, or a router
  in front of one prefill and one decode worker). This is what the autoscaler's numbers mean: what one
  instance sustains, seen from outside, including the HTTP path.
- `--model DIR`: in-process on this machine's engine (no server), which can also compare KV block sizes
  (`--block-sizes 16,32`): smaller blocks waste less memory per sequence, larger ones gather fewer
  blocks per decode step.

Decode throughput at batch B is B / TPOT (B requests decoding together), so prefill work does not blur
it; prefill capacity is prompt tokens / wall time with enough long prompts in flight to saturate.

Against a router (`--url` of a disaggregated stack) it also measures t_join, the decode instance-seconds of
admitting one transferred request (KV import, scheduling), which C_d leaves out: requests of four tokens,
one at a time, and the decode workers' mean `pdcluster_decode_join_seconds` (KV complete -> first output)
less their mean step (`pdcluster_time_per_output_token_seconds`) over them, as the autoscaler computes it
live (`autoscaler_rules.join_cost`). It goes into `pdcluster plan --decode-join-seconds`.

With `--stream-rate R --instance-cpus C` (a router of CPU-limited workers) it also measures each pool's cost
per request under a stream of arrivals, admission work included (bench/profile_stream.py): the prefill
capacity and t_join the formula should use where the workers are CPU-bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict

from pdcluster.bench.capacity import capacity_yaml, choose_decode_batch, find_knee
from pdcluster.bench.stats import parse_int_list, percentile
from pdcluster.operator.autoscaler_rules import join_cost
from pdcluster.worker.api import cli_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="worker (role both) or router base URL")
    src.add_argument("--model", help="Hugging Face model folder: measure in-process")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64", help="decode batch sizes to measure")
    p.add_argument("--prefill-len", type=cli_args.positive_int, default=512, help="prompt length for the prefill measurement")
    p.add_argument("--prefill-concurrency", default="1,2,4,8", help="prompts in flight (URL mode)")
    p.add_argument("--prefill-requests", type=cli_args.positive_int, default=None,
                   help="--model only: prompts queued at once (default: two full prefill steps' worth)")
    p.add_argument("--decode-prompt-len", type=cli_args.positive_int, default=16)
    p.add_argument("--decode-len", type=cli_args.positive_int, default=64, help="output tokens per decode request")
    p.add_argument("--tpot-slo", type=cli_args.positive_float, default=None, help="cap the batch so TPOT p50 <= this (seconds)")
    p.add_argument("--knee-frac", type=cli_args.fraction, default=0.9, help="knee = smallest batch reaching this share of peak")
    p.add_argument("--block-sizes", default="16,32", help="--model only: KV block sizes to compare")
    p.add_argument("--device", default="cpu", help="--model only: cpu | cuda")
    p.add_argument("--dtype", default="auto", help="--model only: model dtype")
    p.add_argument("--kv-cache-dtype", default="auto", help="--model only: auto | int8 | int4")
    p.add_argument("--threads", type=cli_args.positive_int, default=None,
                   help="--model only: torch CPU threads (1 gives steadier figures on a busy machine)")
    p.add_argument("--repeats", type=cli_args.positive_int, default=3,
                   help="--model only: measure each point this many times and keep the fastest (a shared "
                        "machine only ever adds time, so the fastest run is the least disturbed)")
    p.add_argument("--timeout", type=cli_args.positive_float, default=300.0)
    p.add_argument("--join-requests", type=cli_args.non_negative_int, default=16,
                   help="--url of a router only: four-token requests of --prefill-len tokens, one at a time, to time "
                        "t_join (0: skip) (default: %(default)s)")
    p.add_argument("--stream-rate", type=cli_args.positive_float, default=None,
                   help="--url of a router only: also send --stream-requests arrivals at this many req/s and measure "
                        "each pool's CPU per request (needs --instance-cpus) (default: no stream step)")
    p.add_argument("--stream-requests", type=cli_args.positive_int, default=120, help="(default: %(default)s)")
    p.add_argument("--stream-input-len", type=cli_args.positive_int, default=None,
                   help="prompt tokens of the stream's requests: the workload's mean (default: --prefill-len)")
    p.add_argument("--stream-output-len", type=cli_args.positive_int, default=20,
                   help="output tokens of the stream's requests: the workload's mean (default: %(default)s)")
    p.add_argument("--instance-cpus", type=cli_args.positive_float, default=None,
                   help="the CPU limit of one worker (its pod's limits.cpu): CPU seconds -> instance-seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text + YAML")


# ----------------------------------------------------------------------------------------------- URL mode

JOIN_SERIES = "pdcluster_decode_join_seconds"
STEP_SERIES = "pdcluster_time_per_output_token_seconds"


def join_totals(metrics_text: str, series: str = JOIN_SERIES) -> tuple[float, float]:
    """(sum, count) of one histogram (default pdcluster_decode_join_seconds) in one /metrics answer, over its
    label sets."""
    total, count = 0.0, 0.0
    for line in metrics_text.splitlines():
        for suffix in ("_sum", "_count"):
            if line.startswith(series + suffix + "{") or line.startswith(series + suffix + " "):
                v = float(line.rsplit(" ", 1)[1])
                total, count = (total + v, count) if suffix == "_sum" else (total, count + v)
    return total, count


def join_seconds(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """The mean of a histogram between two (sum, count) readings; None if nothing was observed."""
    n = after[1] - before[1]
    return (after[0] - before[0]) / n if n > 0 else None


async def _decode_join(client, router: str, wave, prompt_len: int) -> dict | None:
    """t_join through a router: None when `router` is not one (a role-both worker never transfers)."""
    try:
        view = (await client.get(f"{router.rstrip('/')}/cluster")).json()
        urls = [w["url"] for w in view.get("decode", []) if w.get("healthy")]
    except Exception:  # not a router, or one without /cluster: nothing to time
        return None
    if not urls:
        return None

    async def read(series: str) -> tuple[float, float]:
        tot = [join_totals((await client.get(f"{u}/metrics")).text, series) for u in urls]
        return sum(t for t, _ in tot), sum(c for _, c in tot)

    before = {s: await read(s) for s in (JOIN_SERIES, STEP_SERIES)}
    # long enough to be disaggregated; four tokens: one transfer, then steps whose time is O/C_d's
    res, _ = await wave(0, prompt_len, 4, 1)
    after = {s: await read(s) for s in (JOIN_SERIES, STEP_SERIES)}
    admit = join_seconds(before[JOIN_SERIES], after[JOIN_SERIES])
    step = join_seconds(before[STEP_SERIES], after[STEP_SERIES])
    return {"seconds": join_cost(admit, step), "admission_seconds": admit, "step_seconds": step,
            "requests": int(after[JOIN_SERIES][1] - before[JOIN_SERIES][1]),
            "errors": sum(1 for r in res if not r.ok), "decode_workers": len(urls)}


async def _profile_url(args) -> dict:
    from pdcluster.bench import loadgen

    url = loadgen.completions_url(args.url)
    batches = parse_int_list(args.batch_sizes)
    rng = random.Random(0)
    async with loadgen.make_client(max(batches) + 8, args.timeout) as client:
        model = await loadgen.discover_model(client, url)
        probe = await loadgen.probe_shape(client, url, model, min(args.timeout, 60))
        if probe.shape is None:
            raise ConnectionError(f"{args.url} does not serve completions ({probe.result.error}: {probe.result.detail})")
        shape = probe.shape  # narrowed here: the closures below cannot see the check above

        async def wave(n: int, prompt_len: int, out_len: int, conc: int):
            n = n or args.join_requests
            payloads = [loadgen.build_payload(prompt_len, out_len, rng, shape, model) for _ in range(n)]
            return await loadgen.run_requests(client, url, payloads, concurrency=conc, timeout=args.timeout)

        await wave(2, 16, 4, 2)  # warm-up: first-call allocations, JIT, connection setup
        prefill = []
        for c in parse_int_list(args.prefill_concurrency):
            res, wall = await wave(max(2 * c, 4), args.prefill_len, 1, c)
            ok = [r for r in res if r.ok]
            tps = sum(r.prompt_tokens for r in ok) / wall if ok and wall > 0 else None
            prefill.append({"concurrency": c, "prompt_tokens_per_second": tps, "errors": len(res) - len(ok),
                            "ttft_p50": percentile([r.ttft for r in ok if r.ttft is not None], 50)})
        decode = []
        for b in batches:
            res, _ = await wave(b, args.decode_prompt_len, args.decode_len, b)
            ok = [r for r in res if r.ok]
            tpots = [t for r in ok if (t := r.tpot) is not None]
            tpot = percentile(tpots, 50)
            decode.append({"batch": b, "output_tokens_per_second": (len(ok) / tpot) if tpot else None,
                           "tpot_p50": tpot, "errors": len(res) - len(ok)})
        join = await _decode_join(client, args.url, wave, args.prefill_len) if args.join_requests else None
        stream = None
        if args.stream_rate:
            async def send(n: int, prompt_len: int, out_len: int, rate: float):
                payloads = [loadgen.build_payload(prompt_len, out_len, rng, shape, model) for _ in range(n)]
                return await loadgen.run_requests(client, url, payloads, rate=rate, timeout=args.timeout)

            stream = await _stream(client, args, send)
    return {"target": args.url, "prefill": prefill, "decode": decode, "decode_join": join, "stream": stream}


async def _stream(client, args, send) -> dict:
    from pdcluster.bench import profile_stream

    view = (await client.get(f"{args.url.rstrip('/')}/cluster")).json()
    urls = {p: [w["url"] for w in view.get(p, []) if w.get("healthy")] for p in profile_stream.POOLS}
    if not urls["prefill"] or not urls["decode"]:
        raise ValueError("--stream-rate needs a router with healthy prefill and decode workers")

    async def read(u: str) -> str:
        return (await client.get(f"{u}/metrics")).text

    return await profile_stream.measure(read, send, urls, rate=args.stream_rate, requests=args.stream_requests,
                                        input_len=args.stream_input_len or args.prefill_len,
                                        output_len=args.stream_output_len, instance_cpus=args.instance_cpus)


# --------------------------------------------------------------------------------------------- model mode


def _engine(args, block_size: int, max_batch: int):
    from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine

    cfg = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, block_size=block_size,
                       kv_cache_dtype=args.kv_cache_dtype, max_batch_size=max_batch,
                       max_batch_tokens=max(2048, args.prefill_len), enable_prefix_caching=False,
                       num_threads=args.threads)
    return LLMEngine(cfg)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _measure_engine(args, block_size: int) -> dict:
    from pdcluster.worker.engine.sampling_params import SamplingParams

    batches = parse_int_list(args.batch_sizes)
    eng = _engine(args, block_size, max(batches))
    vocab = eng.model_config.vocab_size
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(5, min(vocab, 250)) for _ in range(n)]  # noqa: E731
    uid = iter(range(1 << 30))
    eng.generate([ids(16)], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up

    # prefill: enough prompts to fill several max_batch_tokens steps; one output token each
    n = args.prefill_requests or min(64, max(4, 2 * eng.config.max_batch_tokens // args.prefill_len))
    best = float("inf")
    for _ in range(max(1, args.repeats)):
        for _ in range(n):
            eng.add_request(f"p{next(uid)}", ids(args.prefill_len),
                            SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        _sync(args.device)
        t0 = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        _sync(args.device)
        best = min(best, time.perf_counter() - t0)
    prefill_tps = n * args.prefill_len / best

    decode = []
    for b in batches:
        params = SamplingParams(max_tokens=args.decode_len, temperature=0.0, ignore_eos=True)
        best_tps, best_step = 0.0, None
        for _ in range(max(1, args.repeats)):
            rids = [f"d{next(uid)}" for _ in range(b)]
            for r in rids:
                eng.add_request(r, ids(args.decode_prompt_len), params)
            started: set[str] = set()
            while len(started) < b:  # prefill every request first; time decode steps only
                started.update(o.request_id for o in eng.step())
            _sync(args.device)
            t0, tokens, steps = time.perf_counter(), 0, 0
            while eng.has_unfinished():
                tokens += sum(len(o.new_token_ids) for o in eng.step())
                steps += 1
            _sync(args.device)
            dt = time.perf_counter() - t0
            if dt > 0 and tokens / dt > best_tps:
                best_tps, best_step = tokens / dt, dt / max(steps, 1)
        decode.append({"batch": b, "output_tokens_per_second": best_tps or None, "tpot_p50": best_step,
                       "errors": 0})
    return {"block_size": block_size, "prefill": [{"concurrency": n, "prompt_tokens_per_second": prefill_tps,
                                                   "errors": 0}], "decode": decode}


def _profile_model(args) -> dict:
    runs = [_measure_engine(args, bs) for bs in parse_int_list(args.block_sizes)]
    out = dict(runs[0])
    out["target"] = args.model
    if len(runs) > 1:
        out["block_sizes"] = [
            {"block_size": r["block_size"],
             "prefill_tokens_per_second": r["prefill"][0]["prompt_tokens_per_second"],
             "decode": r["decode"]} for r in runs
        ]
    return out


# ------------------------------------------------------------------------------------------------ report


def _decode_points(s: dict) -> list[tuple[int, float, float | None]]:
    return [(d["batch"], d["output_tokens_per_second"], d["tpot_p50"]) for d in s["decode"]
            if d["output_tokens_per_second"]]


def summarize(raw: dict, frac: float = 0.9, tpot_slo: float | None = None) -> dict:
    """Add the capacities and the knee to a raw measurement (pure)."""
    pre = [(p["concurrency"], p["prompt_tokens_per_second"]) for p in raw["prefill"] if p["prompt_tokens_per_second"]]
    dec = _decode_points(raw)
    out = dict(raw)
    out["prefill_tokens_per_second"] = max((t for _, t in pre), default=None)
    out["prefill_knee_concurrency"] = find_knee(pre, frac)[0] if pre else None
    out["decode_join_seconds"] = (raw.get("decode_join") or {}).get("seconds")
    if dec:
        knee = choose_decode_batch(dec, frac, tpot_slo)
        out["decode_knee"] = {**asdict(knee), "reason": knee.reason}
        out["decode_tokens_per_second"] = knee.throughput
        out["recommended_max_batch_size"] = knee.batch
    else:
        out["decode_knee"] = out["decode_tokens_per_second"] = out["recommended_max_batch_size"] = None
    if raw.get("stream"):  # the formula's inputs under arrivals (bench/profile_stream.py)
        from pdcluster.bench.profile_stream import stream_costs

        out["stream_costs"] = stream_costs(raw["stream"], out["decode_tokens_per_second"])
    for r in out.get("block_sizes", []):
        d = [(x["batch"], x["output_tokens_per_second"], x["tpot_p50"]) for x in r["decode"] if x["output_tokens_per_second"]]
        r["decode_peak_tokens_per_second"] = max((t for _, t, _ in d), default=None)
    return out


def _mark(knee: dict) -> str:
    if knee["limited_by_slo"]:
        return "TPOT objective"
    return "knee" if knee["found"] else "largest measured (no knee)"


def format_report(s: dict) -> str:
    lines = [f"profile of {s['target']}", "", "prefill (prompt tokens/s):"]
    for p in s["prefill"]:
        tps = p["prompt_tokens_per_second"]
        lines.append(f"  {p['concurrency']:>4} in flight  {tps or 0:>10.0f}" + (f"  errors {p['errors']}" if p["errors"] else ""))
    lines += ["", "decode:", f"  {'batch':>5} {'out tok/s':>10} {'TPOT p50':>9}"]
    knee = s.get("decode_knee") or {}
    for d in s["decode"]:
        mark = f"  <- {_mark(knee)}" if d["batch"] == knee.get("batch") else ""
        tpot = d["tpot_p50"]
        lines.append(f"  {d['batch']:>5} {d['output_tokens_per_second'] or 0:>10.1f} "
                     f"{(tpot or 0) * 1000:>7.1f}ms{mark}" + (f"  errors {d['errors']}" if d["errors"] else ""))
    if knee and not knee["found"]:
        largest = max(b for b, *_ in _decode_points(s))
        lines.append(f"  no knee found: throughput still growing at batch {largest}, the largest measured; "
                     f"measure larger --batch-sizes to find it")
    if knee:
        lines.append(f"  recommended max batch size: {knee['batch']} ({knee['reason']})")
    if s.get("decode_join_seconds") is not None:
        j = s.get("decode_join") or {}
        lines.append(f"  t_join (admitting a transferred request, less one step): {s['decode_join_seconds'] * 1000:.1f} ms "
                     f"per request (admission {1000 * (j.get('admission_seconds') or 0):.1f} ms, step "
                     f"{1000 * (j.get('step_seconds') or 0):.1f} ms) -> pdcluster plan --decode-join-seconds "
                     f"{s['decode_join_seconds']:.4g}")
    lines += _stream_lines(s)
    for r in s.get("block_sizes", []):
        lines.append(f"\nblock size {r['block_size']:>2}: prefill {r['prefill_tokens_per_second']:.0f} tok/s, "
                     f"decode peak {r['decode_peak_tokens_per_second'] or 0:.1f} tok/s")
    if len(s.get("block_sizes", [])) == 2:
        a, b = s["block_sizes"]
        if a["decode_peak_tokens_per_second"] and b["decode_peak_tokens_per_second"]:
            ratio = b["decode_peak_tokens_per_second"] / a["decode_peak_tokens_per_second"]
            lines.append(f"block size {b['block_size']} vs {a['block_size']}: decode x{ratio:.2f}")
    lines += ["", capacity_yaml(s["prefill_tokens_per_second"], s["decode_tokens_per_second"],
                                max_batch_size=s["recommended_max_batch_size"], batch_reason=knee.get("reason", ""),
                                comment=f"pdcluster profile {s['target']} {time.strftime('%Y-%m-%d')}")]
    return "\n".join(lines)


def _stream_lines(s: dict) -> list[str]:
    st, c = s.get("stream"), s.get("stream_costs")
    if not st or not c or c["prefill_seconds"] is None or c["decode_seconds"] is None:
        return []
    lines = [f"  under a stream of {st['rate']:g} req/s ({st['ok']}/{st['requests']} ok, {st['input_len']} in / "
             f"{st['output_len']} out, {st['instance_cpus']:g} CPU per instance): prefill "
             f"{1000 * c['prefill_seconds']:.1f} ms, decode {1000 * c['decode_seconds']:.1f} ms per request"]
    if c["prefill_tokens_per_second"] and c["decode_join_seconds"] is not None:
        lines.append(f"  -> pdcluster plan --prefill-capacity {c['prefill_tokens_per_second']:.4g} --decode-capacity "
                     f"{s['decode_tokens_per_second']:.4g} --decode-join-seconds {c['decode_join_seconds']:.4g}")
    return lines


def run(args: argparse.Namespace) -> int:
    try:
        parse_int_list(args.batch_sizes)
        if args.url:
            from pdcluster.bench.loadgen import completions_url

            completions_url(args.url)
        if args.stream_rate and not (args.url and args.instance_cpus):
            raise ValueError("--stream-rate needs --url (a router) and --instance-cpus (one worker's CPU limit)")
    except ValueError as e:
        print(f"pdcluster profile: {e}", file=sys.stderr)
        return 2
    try:
        raw = asyncio.run(_profile_url(args)) if args.url else _profile_model(args)
    except (ConnectionError, OSError, ValueError) as e:
        print(f"pdcluster profile: {e}", file=sys.stderr)
        return 1
    s = summarize(raw, args.knee_frac, args.tpot_slo)
    print(json.dumps(s, indent=1) if args.json else format_report(s))
    return 0 if s["prefill_tokens_per_second"] or s["decode_tokens_per_second"] else 1
