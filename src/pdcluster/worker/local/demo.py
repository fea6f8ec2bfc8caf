"""`pdcluster up --demo`: drive a short mixed workload through the router and print what a user should look
at — TTFT and TPOT percentiles (the two phases, measured separately), throughput, and the P:D split the
operator's planner would choose for the capacities and traffic just measured."""

from __future__ import annotations

import asyncio

from pdcluster.operator.planner import plan
from pdcluster.worker.local.workload import Req, fmt_ms, mixed, run


def pd_lines(mean_in: float, mean_out: float, c_p: float, c_d: float, rate: float, running: tuple[int, int]
             ) -> list[str]:
    """The P:D decision of the operator's planner (the one P:D formula in the tree) for what was measured."""
    p = plan(input_len=mean_in, output_len=mean_out, prefill_capacity=c_p, decode_capacity=c_d,
             request_rate=rate, headroom=1.5)
    return [f"  measured capacity per instance: prefill {c_p:.0f} prompt tok/s, decode {c_d:.0f} output tok/s",
            f"  workload: mean {mean_in:.0f} in / {mean_out:.0f} out tokens at {rate:.2f} req/s",
            f"  P:D decision (operator planner, headroom 1.5): {p.prefill_replicas} prefill : {p.decode_replicas} "
            f"decode  (decode/prefill time ratio {p.ratio:.2f}; running {running[0]}:{running[1]})"]


def demo(router: str, *, n_prefill: int, n_decode: int) -> int:
    print("\nwarming up and measuring per-instance capacity ...", flush=True)
    # Prefill capacity: a long prompt alone; its TTFT is (almost) pure prefill time.
    asyncio.run(run(router, [Req(512, 1, 0.0)]))  # warm-up (first-call allocations), not measured
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
        print("\n" + "\n".join(pd_lines(mean_in, mean_out, c_p, c_d, rate, (n_prefill, n_decode))))
    return 0 if s.ok == s.requests else 1
