"""`pdcluster simulate --trace FILE --out DIR [--policy NAME ...] [--slo-ttft S] [--slo-tpot S] [--speedup X]
[--prefill-capacity T] [--decode-capacity T]`.

Writes DIR/summary.json ({"trace": {...}, "policies": {name: {...}}, plus the goal check and the setup})
and DIR/replicas.png (P and D over time against the load), DIR/tradeoff.png (SLO attainment vs
instance-hours); with `--decisions`, DIR/decisions-POLICY.csv for each policy built on the operator's
`decide` (`decisions.py`: one row per autoscaler tick). Bad input: one error line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import NoReturn

from pdcluster.bench import trace as tr
from pdcluster.bench.sim import policies as pol
from pdcluster.bench.sim.cluster import RunResult, simulate
from pdcluster.bench.sim.decisions import write_csv as write_decisions
from pdcluster.bench.sim.feasibility import feasibility
from pdcluster.bench.sim.model import SLO, ServiceModel, capacities_from_profile
from pdcluster.bench.sim.report import (
    attainment,
    goal_check,
    plot_replicas,
    plot_tradeoff,
    policy_summary,
    trace_summary,
)
from pdcluster.bench.sim.search import generous_sizes, static_best
from pdcluster.operator.autoscaler_flip_window import period as flip_period
from pdcluster.worker.api import cli_args

FLIP_WINDOW_S = pol.FLIP_WINDOW_S  # --flip-window's default: the CRD's spec.autoscaling.flipWindowSeconds

PROG = "pdcluster simulate"


class UsageError(ValueError):
    pass


def _error(self: argparse.ArgumentParser, message: str) -> NoReturn:
    # One line, not argparse's usage dump: scripts built on this contract parse stderr.
    print(f"{PROG}: error: {message} (see --help)", file=sys.stderr)
    raise SystemExit(2)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.error = _error.__get__(p)  # type: ignore[method-assign]
    p.add_argument("--trace", required=True, type=Path, help="Azure CSV or Mooncake JSONL trace")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--policy", action="extend", nargs="+", default=None, metavar="NAME",
                   help=f"policies to compare (default: all of {', '.join(pol.NAMES)}; also {', '.join(pol.EXTRA)}, "
                        "static-P:D)")
    p.add_argument("--slo-ttft", type=cli_args.positive_float, default=SLO.ttft_s, help="TTFT SLO, seconds (default 5)")
    p.add_argument("--slo-tpot", type=cli_args.positive_float, default=SLO.tpot_s, help="TPOT SLO, seconds (default 0.1)")
    p.add_argument("--slo-target", type=cli_args.fraction, default=SLO.target,
                   help="share of requests that must meet both SLOs (default 0.99)")
    p.add_argument("--speedup", type=cli_args.positive_float, default=1.0, help="replay the trace X times faster")
    p.add_argument("--prefill-capacity", type=cli_args.positive_float, default=None,
                   help="prompt tokens/s per prefill instance (default 10000, or --profile's)")
    p.add_argument("--decode-capacity", type=cli_args.positive_float, default=None,
                   help="output tokens/s per decode instance at full batch (default 2000, or --profile's)")
    p.add_argument("--profile", type=Path, default=None, help="capacities from `pdcluster profile --json` output")
    p.add_argument("--decode-batch", type=cli_args.positive_int, default=None, help="decode batch limit (default 32)")
    p.add_argument("--pod-start", type=cli_args.non_negative_float, default=ServiceModel.pod_start_s, help="pod start delay, s")
    p.add_argument("--flip-time", type=cli_args.non_negative_float, default=ServiceModel.flip_s,
                   help="seconds a drained worker takes to serve its other role (role flips: every policy built on the "
                   "operator's decide but pdcluster-no-flips; default 5)")
    p.add_argument("--fast-path", type=cli_args.non_negative_float, default=0.0, metavar="SECONDS",
                   help="run the autoscaler's fast scale-up path on the queue gauges every SECONDS between its "
                   "decisions (operator/autoscaler_fast.py; default 0: off)")
    p.add_argument("--flip-window", type=cli_args.non_negative_float, default=FLIP_WINDOW_S, metavar="SECONDS",
                   help="role flips on a SECONDS window of rate and lengths besides the decisions' "
                   "(spec.autoscaling.flipWindowSeconds, operator/autoscaler_flip_window.py; default "
                   f"{FLIP_WINDOW_S:g}, the CRD's; 0: off)")
    p.add_argument("--flip-tick", type=cli_args.non_negative_float, default=None, metavar="SECONDS",
                   help="run the short-window flip step every SECONDS between decisions (default: a quarter of the flip "
                   "window, 5 s at least, as the operator does; 0: only on the decisions' tick)")
    p.add_argument("--scrape-interval", type=cli_args.non_negative_float, default=ServiceModel.scrape_s,
                   metavar="SECONDS", help="Prometheus scrapes the router's counters every SECONDS, and every "
                   "autoscaler step reads them as of the last scrape, half an interval before it (default 0: "
                   "read exactly at each step)")
    p.add_argument("--headroom", type=cli_args.between(1.0, 10.0), default=1.5,
                   help="spec.autoscaling.headroom of the pdcluster policies (default 1.5, the CRD default)")
    p.add_argument("--cold", action="store_true",
                   help="autoscaled policies start from the formula's size for the first 120 s and an empty "
                   "state, instead of from a first pass over the trace (the default: the hour before "
                   "looked like this one)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="no prefix caching in the prefill instances (default: an LRU of 500k tokens each)")
    p.add_argument("--load-aggregation", action="store_true",
                   help="the router's load-driven aggregation with --slo-ttft as its target (the operator passes "
                   "spec.autoscaling.slo.ttftSeconds as the router's --ttft-slo): while the prefill queue would "
                   "miss it, decode instances with a free slot prefill new prompts themselves")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    p.add_argument("--decisions", action="store_true",
                   help="also write DIR/decisions-POLICY.csv: every autoscaler tick of the measured pass of each "
                   "policy built on the operator's decide (what it saw, the pools, what it decided)")


def _model(args: argparse.Namespace) -> ServiceModel:
    cp, cd, batch = None, None, None
    if args.profile is not None:
        cp, cd, batch = capacities_from_profile(args.profile)
    cp = args.prefill_capacity or cp or ServiceModel.prefill_tps
    cd = args.decode_capacity or cd or ServiceModel.decode_tps
    batch = args.decode_batch or batch or ServiceModel.decode_batch
    for flag, v in (("--prefill-capacity", args.prefill_capacity), ("--decode-capacity", args.decode_capacity)):
        if v is not None and not v > 0:
            raise UsageError(f"{flag} must be > 0 (got {v})")
    return ServiceModel(prefill_tps=float(cp), decode_tps=float(cd), decode_batch=int(batch),
                        pod_start_s=args.pod_start, flip_s=args.flip_time, prefix_cache_tokens=0 if args.no_prefix_cache else
                        ServiceModel.prefix_cache_tokens,
                        aggregate_ttft_s=args.slo_ttft if getattr(args, "load_aggregation", False) else 0.0,
                        scrape_s=getattr(args, "scrape_interval", 0.0))


def run_policy(trace: tr.Trace, model: ServiceModel, slo: SLO, name: str, primed: bool = True,
               headroom: float = 1.5, log: bool = False, fast_s: float = 0.0, flip_window_s: float | None = None,
               flip_tick_s: float | None = None, prime: tr.Trace | None = None) -> RunResult:
    """An autoscaled policy over the trace; `primed`: after a first pass whose final state and sizes it
    starts from (the hour before looked like this one; see policies.carry_over), over `prime` if given (an
    hour of the same kind, not the same hour: the held-out sweep's `--prime other`), else over the trace."""
    first_trace = prime if primed and prime is not None else trace
    policy = pol.make(name, model.prefill_tps, model.decode_tps, trace=first_trace, slo=slo, headroom=headroom,
                      fast_s=fast_s, flip_window_s=flip_window_s, flip_tick_s=flip_tick_s)
    if primed:
        first = simulate(first_trace, model, policy)
        policy = pol.carry_over(policy, first_trace.duration_s, (first.timeline[-1][1], first.timeline[-1][2]))
        if first_trace is not trace:
            policy = pol.for_trace(policy, trace)
    if log and hasattr(policy, "log"):
        policy.log = []
    return simulate(trace, model, policy)


def run_all(trace: tr.Trace, model: ServiceModel, slo: SLO, names: list[str], primed: bool = True,
            headroom: float = 1.5, log: bool = False, fast_s: float = 0.0, flip_window_s: float | None = None,
            flip_tick_s: float | None = None, prime: tr.Trace | None = None) -> tuple[dict, dict[str, RunResult]]:
    runs: dict[str, RunResult] = {}
    cache: dict[tuple[int, int], RunResult] = {}

    def static(p: int, d: int) -> RunResult:
        if (p, d) not in cache:
            cache[(p, d)] = simulate(trace, model, pol.Static(p, d))
        return cache[(p, d)]

    for name in names:
        if name == "static-best":
            p_hi, d_hi = generous_sizes(trace, model.prefill_tps, model.decode_tps, model.decode_batch)
            p, d, _ = static_best(lambda p, d: attainment(static(p, d), slo), slo.target, p_hi, d_hi)
            runs[name] = static(p, d)
        elif name.startswith("static-"):
            s = pol.make(name, model.prefill_tps, model.decode_tps)
            runs[name] = static(s.prefill, s.decode)
        else:
            runs[name] = run_policy(trace, model, slo, name, primed, headroom, log, fast_s, flip_window_s, flip_tick_s,
                                    prime)
    feasible = feasibility(trace, model, slo).feasible
    summaries = {n: policy_summary(r, slo, feasible) for n, r in runs.items()}
    if "static-best" in runs:
        best = runs["static-best"]
        summaries["static-best"]["size"] = f"{best.timeline[0][1]}:{best.timeline[0][2]}"
        summaries["static-best"]["static_runs_searched"] = len(cache)
    return summaries, runs


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    try:
        names = list(dict.fromkeys(args.policy or pol.NAMES))
        for n in names:
            if n != "static-best":
                pol.make(n, 1.0, 1.0)  # validates the name
        if not 1.0 <= args.headroom <= 10.0:
            raise UsageError(f"--headroom must be in [1, 10] (got {args.headroom})")
        if not args.speedup > 0:
            raise UsageError(f"--speedup must be > 0 (got {args.speedup})")
        slo = SLO(args.slo_ttft, args.slo_tpot, args.slo_target)
        model = _model(args)
        trace = tr.scale_time(tr.read_trace(args.trace), args.speedup)
        if args.policy is None:
            names = pol.default_names(trace)
        if len(trace.requests) < 2 or trace.duration_s <= 0:
            raise UsageError(f"{args.trace}: the trace needs at least two requests over a positive span")
        args.out.mkdir(parents=True, exist_ok=True)
    except (ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    flip_tick = args.flip_tick if args.flip_tick is not None else flip_period(args.flip_window)
    summaries, runs = run_all(trace, model, slo, names, primed=not args.cold, headroom=args.headroom,
                              log=args.decisions, fast_s=args.fast_path, flip_window_s=args.flip_window,
                              flip_tick_s=flip_tick)
    for name, r in runs.items():
        if r.decision_log:
            write_decisions(args.out / f"decisions-{name}.csv", r.decision_log)
    elapsed = time.perf_counter() - t0
    doc = {
        "trace": {**trace_summary(trace),
                  "infeasible_requests": feasibility(trace, model, slo).summary(slo, model)},
        "policies": summaries,
        "goal": goal_check(summaries, slo.target),
        "setup": {"source": str(args.trace), "speedup": args.speedup, "slo_ttft_s": slo.ttft_s,
                  "slo_tpot_s": slo.tpot_s, "slo_target": slo.target, "prefill_capacity": model.prefill_tps,
                  "decode_capacity": model.decode_tps, "decode_batch": model.decode_batch,
                  "pod_start_s": model.pod_start_s, "flip_s": model.flip_s, "max_queue_depth": model.max_queue_depth,
                  "primed": not args.cold, "prefix_cache_tokens": model.prefix_cache_tokens,
                  "load_aggregation_ttft_s": model.aggregate_ttft_s, "burst_window_s": pol.BURST_S, "headroom": args.headroom, "fast_path_s": args.fast_path,
                  "flip_window_s": args.flip_window, "flip_tick_s": flip_tick, "scrape_interval_s": model.scrape_s,
                  "simulation_seconds": round(elapsed, 2)},
    }
    (args.out / "summary.json").write_text(json.dumps(doc, indent=1))
    title = f"{Path(args.trace).name} (x{args.speedup:g}; SLO TTFT {slo.ttft_s:g}s TPOT {slo.tpot_s:g}s)"
    if not args.no_plots:
        plot_replicas(trace, runs, args.out / "replicas.png", title)
        plot_tradeoff(summaries, args.out / "tradeoff.png", title, slo.target)
    print(format_table(summaries))
    print(f"simulated {len(trace.requests)} requests over {trace.duration_s / 60:.1f} min, "
          f"{len(names)} policies in {elapsed:.1f}s; wrote {args.out}/summary.json")
    return 0


def format_table(policies: dict[str, dict]) -> str:
    w = max([14, *(len(n) for n in policies)])
    lines = [f"{'policy':<{w}} {'SLO ok':>7} {'feasible':>8} {'TTFT p99':>9} {'TPOT p99':>9} {'inst-h':>7} {'P-h':>6} "
             f"{'D-h':>6} {'events':>6} {'flips':>5} {'maxP':>5} {'maxD':>5}"]
    for n, p in policies.items():
        lines.append(f"{n:<{w}} {100 * p['slo_attainment']:>6.2f}% {100 * p['slo_attainment_feasible']:>7.2f}% "
                     f"{p['ttft_p99_s']:>8.2f}s {p['tpot_p99_s']:>8.3f}s "
                     f"{p['instance_hours']:>7.2f} {p['prefill_instance_hours']:>6.2f} "
                     f"{p['decode_instance_hours']:>6.2f} {p['scale_events']:>6} {p['role_flips']:>5} "
                     f"{p['max_prefill']:>5} {p['max_decode']:>5}")
    return "\n".join(lines)
