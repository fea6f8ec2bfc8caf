"""`pdcluster up --demo`: drive a short mixed workload through the router and print what a user should look
at — TTFT and TPOT percentiles (the two phases, measured separately), throughput, and the P:D split the
operator's planner would choose for the capacities and traffic just measured."""

from __future__ import annotations

import asyncio
from typing import Any

from pdcluster.worker.local.workload import Req, fmt_ms, mixed, run


def plan_pd(input_len: float, output_len: float, c_p: float, c_d: float, rate: float) -> dict[str, Any]:
    """P:D from pdcluster.operator.planner when importable, else the same formula inline."""
    try:
        from pdcluster.operator.planner import plan

        p = plan(input_len=input_len, output_len=output_len, prefill_capacity=c_p, decode_capacity=c_d,
                 request_rate=rate, headroom=1.5)
        return {"prefill": p.prefill_replicas, "decode": p.decode_replicas, "ratio": p.ratio, "source": "operator"}
    except ImportError:
        import math

        sp, sd = input_len / c_p, output_len / c_d
        return {"prefill": max(1, math.ceil(1.5 * rate * sp)), "decode": max(1, math.ceil(1.5 * rate * sd)),
                "ratio": sd / sp, "source": "inline"}


def demo(router: str, *, n_prefill: int, n_decode: int) -> int:
    print("\nwarming up and measuring per-instance capacity ...", flush=True)
    # Prefill capacity: a long prompt alone; its TTFT is (almost) pure prefill time.
    warm, _ = asyncio.run(run(router, [Req(512, 1, 0.0)]))
    cal_p, _ = asyncio.run(run(router, [Req(512, 1, 0.0)]))
    c_p = 512 / cal_p.ttft_p50 if cal_p.ttft_p50 else 0.0
    # Decode capacity: a full batch of short prompts; tokens after the first over the time they took.
    cal_d, res_d = asyncio.run(run(router, [Req(8, 32, 0.0)] * 8))
    spans = [r.tpot * (r.tokens - 1) for r in res_d if r.tpot]
    c_d = sum(r.tokens - 1 for r in res_d if r.tpot) / max(spans) / max(1, n_decode) if spans else 0.0

    reqs = mixed(n_short=24, n_long=4, long_len=512, short_out=32, long_out=8, rate=4.0)
    print(f"mixed workload: {len(reqs)} requests (4 x 512-token prompts among 24 short ones), streamed ...",
          flush=True)
    s, results = asyncio.run(run(router, reqs))
    print(f"\n  requests       {s.ok}/{s.requests} ok, {s.rejected_429} rejected (429), {s.errors} errors")
    print(f"  TTFT           p50 {fmt_ms(s.ttft_p50)}   p99 {fmt_ms(s.ttft_p99)}"
          f"   (short prompts p99 {fmt_ms(s.short_ttft_p99)}, long p99 {fmt_ms(s.long_ttft_p99)})")
    print(f"  TPOT           p50 {fmt_ms(s.tpot_p50)}   p99 {fmt_ms(s.tpot_p99)}")
    print(f"  throughput     {s.throughput_tok_s:.1f} output tok/s over {s.wall_s:.1f} s")
    if c_p > 0 and c_d > 0 and s.ok:
        mean_in = sum(r.prompt_len for r in results) / len(results)
        mean_out = sum(r.max_tokens for r in results) / len(results)
        rate = len(results) / s.wall_s
        pd = plan_pd(mean_in, mean_out, c_p, c_d, rate)
        print(f"\n  measured capacity per instance: prefill {c_p:.0f} prompt tok/s, decode {c_d:.0f} output tok/s")
        print(f"  workload: mean {mean_in:.0f} in / {mean_out:.0f} out tokens at {rate:.2f} req/s")
        print(f"  P:D decision ({pd['source']} planner, headroom 1.5): {pd['prefill']} prefill : {pd['decode']} "
              f"decode  (decode/prefill time ratio {pd['ratio']:.2f}; running {n_prefill}:{n_decode})")
    return 0 if s.ok == s.requests else 1
