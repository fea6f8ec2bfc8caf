"""The P:D ratio checked on the real stack: a fixed budget of N workers, `pdcluster up` at every split
(colocated 0:N included), the same trace slice replayed open-loop through each (`pdcluster bench
--trace`), goodput (requests/s within SLO) per split, and where the planner's formula falls among them.

    python -m benchmarks.ratio_sweep --trace ../shared/traces/azure2023_code.csv --out DIR

With --scan-speedups, one run of --scan-split per speedup picks the load first: the highest speedup at which
that split still answers --scan-attainment of the requests within SLO (below it every split meets the SLO,
far above it every split collapses). Capacities and t_join come from `pdcluster profile --url` against a
1:1 stack of the same workers, with its stream step at the sweep's arrival rate times 2/N (C_p and t_join
under arrivals; --no-stream-profile: the closed-batch and one-at-a-time figures), or from
--prefill-capacity/--decode-capacity/--decode-join-seconds; I and O are the slice's mean lengths after
length scaling (with --max-output-tokens, outputs keep their real lengths up to that cap and prompts alone
shrink). The formula's split is the planner's answer for the budget, its colocation advice (with the
sweep's TPOT objective) included. The splits run interleaved, round after round, so a machine whose load
drifts hurts every split alike.
Writes DIR/summary.json and DIR/goodput.png; the per-run request records stay under --work.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import cpu_limits, local_stack
from benchmarks import ratio_plan as rp
from pdcluster.bench import trace as tr
from pdcluster.bench.stats import percentile


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, required=True, help="Azure CSV or Mooncake JSONL trace")
    p.add_argument("--max-model-len", type=int, default=1024,
                   help="shrink lengths by one factor so the longest fits (the demo model allows 2048)")
    p.add_argument("--max-output-tokens", type=int, default=None,
                   help="keep output lengths (clipped to this) and shrink prompts alone to fit --max-model-len")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--kv-transfer-backend", choices=("auto", "nixl", "tcp"), default="tcp",
                   help="passed to `pdcluster up`; tcp by default: on a CPU box an idle worker whose NIXL loads "
                        "(auto) spends ~1 core in a native thread (measured 18:19, docs/benchmarks/ratio_sweep.md at 5f904a5)")
    p.add_argument("--port", type=int, default=18600, help="router port of the stacks started")
    p.add_argument("--out", type=Path, required=True, help="summary.json and the plot go here")
    p.add_argument("--worker-cpu", type=float, default=0.4,
                   help="CPU limit of each worker (a cgroup v1 CFS quota, as a pod's limits.cpu); 0 = no limits. "
                        "The default fits 4 workers + the router into 2 cores")
    p.add_argument("--router-cpu", type=float, default=0.4, help="CPU limit of the router (with --worker-cpu)")
    p.add_argument("--work", type=Path, default=Path("/tmp/pdcluster-bench-ratio"), help="per-run records")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ratio_sweep", description=__doc__.split("\n")[0])
    add_common(p)
    p.add_argument("--start", type=float, default=1320.0, help="slice start in the trace (seconds)")
    p.add_argument("--duration", type=float, default=30.0, help="slice length in trace seconds")
    p.add_argument("--speedup", type=float, default=0.4,
                   help="replay the slice this many times faster (< 1: slower, for a busy 2-core machine)")
    p.add_argument("--workers", type=int, default=4, help="the fixed budget N")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--splits", default=None, help="only these, e.g. 1:3,3:1 (default: every split of N)")
    p.add_argument("--no-colocated", action="store_true", help="leave out 0:N")
    p.add_argument("--slo-ttft", type=float, default=5.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.5, help="seconds")
    p.add_argument("--prefill-capacity", type=float, default=None, help="prompt tok/s per instance (else profiled)")
    p.add_argument("--decode-capacity", type=float, default=None, help="output tok/s per instance (else profiled)")
    p.add_argument("--decode-join-seconds", type=float, default=None,
                   help="t_join: decode seconds per admitted request (else profiled; 0 = the formula without it)")
    p.add_argument("--scan-speedups", default=None,
                   help="first one run of --scan-split at each of these speedups (e.g. 2,3,4); the sweep then runs at "
                        "the highest one where it met the SLO for --scan-attainment of the requests")
    p.add_argument("--scan-split", default="0:4", help="the split the rate scan runs (the best of earlier sweeps)")
    p.add_argument("--scan-attainment", type=float, default=0.8, help="share within SLO the scan asks for")
    p.add_argument("--no-stream-profile", action="store_true",
                   help="profile without the stream step (C_p closed-batch, t_join one request at a time)")
    return p.parse_args(argv)


def load_slice(path: Path, start: float, duration: float, max_model_len: int,
               max_output_tokens: int | None = None) -> tr.Trace:
    """The slice as the replay sends it (window first, then the lengths), before time scaling."""
    sl = tr.time_window(tr.read_trace(path), start, start + duration)
    return tr.fit_prompts(sl, max_model_len, max_output_tokens) if max_output_tokens else \
        tr.scale_lengths(sl, max_model_len)


def cpu_limit(args: argparse.Namespace) -> local_stack.CpuLimit | None:
    """The per-process CPU limits of the runs (None: unlimited, every process shares the whole machine)."""
    if not args.worker_cpu:
        return None
    cpu_limits.check_budget(args.worker_cpu, args.workers, args.router_cpu, os.cpu_count() or 1)
    cpu_limits.quota_us(args.router_cpu)
    return local_stack.CpuLimit(worker=args.worker_cpu, router=args.router_cpu)


def uptime() -> str:
    """`uptime` as run (the load average at a run's edges, as the project's benchmark pages report it)."""
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def throttled(stats: dict[str, dict[str, int]]) -> dict[str, float | None]:
    """Share of CFS periods throttled, per group (router, prefill-PORT, decode-PORT...)."""
    return {name: cpu_limits.throttled_share(st) for name, st in sorted(stats.items())}


def cores_received(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """Cores each group got over a span (CPU seconds used / wall seconds): under contention this, not the
    quota, is what a worker had."""
    return {g: (after[g] - before.get(g, 0.0)) / wall_s for g in sorted(after)} if wall_s > 0 else {}


def measure_capacity(args: argparse.Namespace, stream_rate: float | None = None,
                     lengths: tuple[float, float] | None = None) -> dict:
    """`pdcluster profile --url` on a 1:1 stack whose two workers run under the sweep's CPU limit, so C_p, C_d
    and t_join are one limited instance's figures, as the formula means them. With `stream_rate` (req/s, the
    sweep's arrival rate scaled to the pair) and the slice's mean `lengths`, C_p and t_join are the stream
    step's (pdcluster.bench.profile_stream); the closed-batch figures are kept beside them."""
    work = args.work / "profile"
    work.mkdir(parents=True, exist_ok=True)
    up = ["--prefill", "1", "--decode", "1", "--threads", str(args.threads),
          "--kv-transfer-backend", args.kv_transfer_backend]
    use = local_stack.Usage()
    stream = None
    if stream_rate and lengths and args.worker_cpu:
        stream = {"rate": stream_rate, "input_len": round(lengths[0]), "output_len": max(1, round(lengths[1])),
                  "instance_cpus": args.worker_cpu}
    with local_stack.up(up, args.port, work / "up.log", (1, 1), cpu=cpu_limit(args), usage=use) as router:
        raw = local_stack.profile(router, stream=stream)
    (work / "profile.json").write_text(json.dumps(raw, indent=1))
    cap = {"prefill_tokens_per_second": raw["prefill_tokens_per_second"],
           "decode_tokens_per_second": raw["decode_tokens_per_second"],
           "decode_join_seconds": raw.get("decode_join_seconds"), "source": "pdcluster profile --url (1:1)",
           "worker_cpu": args.worker_cpu or None, "throttled": throttled(use.stat), "uptime": uptime()}
    costs = raw.get("stream_costs") or {}
    if costs.get("prefill_tokens_per_second") and costs.get("decode_join_seconds") is not None:
        cap["closed"] = {k: cap[k] for k in ("prefill_tokens_per_second", "decode_join_seconds")}
        cap.update(prefill_tokens_per_second=costs["prefill_tokens_per_second"],
                   decode_join_seconds=costs["decode_join_seconds"], stream=raw["stream"],
                   source="pdcluster profile --url --stream-rate (1:1)")
    return cap


def scan(args: argparse.Namespace) -> tuple[float, list[dict]]:
    """One run of --scan-split per --scan-speedups value, ascending; the sweep's speedup (`rp.pick_speedup`)."""
    split = tuple(int(x) for x in args.scan_split.split(":"))
    rows = []
    for i, sp in enumerate(sorted(float(x) for x in args.scan_speedups.split(","))):
        row = one_run(argparse.Namespace(**{**vars(args), "speedup": sp}), split, 100 + i,  # type: ignore[arg-type]
                      args.port + 10 * (i % 4), args.duration / sp)
        rows.append({**row, "speedup": sp})
    return rp.pick_speedup([(r["speedup"], r["attainment"]) for r in rows], args.scan_attainment), rows


def one_run(args: argparse.Namespace, split: tuple[int, int], rnd: int, port: int, span: float) -> dict:
    """A run whose stack never became ready is tried again once (the replay itself is never repeated)."""
    try:
        return one_try(args, split, rnd, port, span)
    except local_stack.StartError as e:
        print(f"ratio_sweep: {split[0]}:{split[1]} round {rnd}: {e}; starting it again", file=sys.stderr, flush=True)
        time.sleep(10)
        return {**one_try(args, split, rnd, port, span), "start_retried": True}


def one_try(args: argparse.Namespace, split: tuple[int, int], rnd: int, port: int, span: float) -> dict:
    p, d = split
    work = args.work / f"r{rnd}-{p}x{d}"
    work.mkdir(parents=True, exist_ok=True)
    flags = ["--prefill", str(p), "--decode", str(d), "--threads", str(args.threads), "--max-queue-depth", "256",
             "--kv-transfer-backend", args.kv_transfer_backend]
    load_before, up_before = os.getloadavg()[0], uptime()
    use = local_stack.Usage()
    with local_stack.up(flags, port, work / "up.log", (p, d), cpu=cpu_limit(args), usage=use) as router:
        local_stack.warm_up(router, work / "warmup")
        t0, cpu0 = time.time(), use.cpu_seconds()
        recs = local_stack.replay(router, args.trace, work / "replay", start=args.start, duration=args.duration,
                                  speedup=args.speedup, max_model_len=args.max_model_len,
                                  max_output_tokens=args.max_output_tokens)
        wall, cpu1 = time.time() - t0, use.cpu_seconds()
        join = local_stack.decode_join(router)  # warm-up included: a few requests of 128-512 tokens
    g = rp.goodput(recs, args.slo_ttft, args.slo_tpot, span)
    ok = [r for r in recs if r.get("ok")]
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    tpot = [r["tpot"] for r in ok if r.get("tpot") is not None]
    row = {"round": rnd, "prefill": p, "decode": d, **g, "wall_s": wall, "load1_before": load_before,
           "load1_after": os.getloadavg()[0], "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
           "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
           "decode_join_seconds_live": join["t_join_s"], "decode_admission_seconds_live": join["admission_s"],
           "decode_step_seconds_live": join["step_s"], "uptime_before": up_before, "uptime_after": uptime(),
           "worker_cpu": args.worker_cpu or None, "throttled": throttled(use.stat),
           "cores_received_replay": cores_received(cpu0, cpu1, wall),
           "errors": sorted({str(r.get("error")) for r in recs if not r.get("ok")})}
    print(json.dumps(row), flush=True)
    return row


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, v = summary["runs"], summary["verdict"]
    order = [tuple(s) for s in summary["splits"] if f"{s[0]}:{s[1]}" in v["mean_goodput_rps"]]  # measured ones
    labels = [f"{p}:{d}" + (" (colocated)" if p == 0 else "") for p, d in order]
    means = [v["mean_goodput_rps"][f"{p}:{d}"] for p, d in order]
    formula = tuple(v["formula"])
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = ["tab:orange" if s == formula else "tab:blue" for s in order]
    alone = tuple(summary["formula"].get("disaggregated") or ()) if formula[0] == 0 else ()
    bars = ax.bar(range(len(order)), means, color=colors, alpha=0.8)
    for b, s in zip(bars, order, strict=True):
        if s == alone:  # the formula's ratio alone, when its answer for the budget is to colocate
            b.set_hatch("//")
    for i, s in enumerate(order):
        ys = [r["goodput_rps"] for r in runs if (r["prefill"], r["decode"]) == s]
        ax.scatter([i] * len(ys), ys, color="black", s=14, zorder=3)
    best = max(means)
    ax.axhline(0.9 * best, color="gray", ls="--", lw=1, label="90 % of the best split")
    ideal = summary["formula"]["ideal_prefill"]
    ax.set_xticks(range(len(order)), labels)
    tj = summary["formula"].get("decode_join_seconds") or 0.0
    rule = summary["formula"].get("rule")
    ax.set_xlabel(f"P:D split of {summary['workers']} workers (orange: the formula's{f' ({rule})' if rule else ''}"
                  f"{'; hatched: its ratio alone' if alone else ''}; t_join {1000 * tj:.0f} ms; ideal P = {ideal:.2f})",
                  fontsize=8)
    ax.set_ylabel("goodput (requests/s within SLO)")
    slo = summary["slo"]
    ax.set_title(f"Ratio sweep, pdcluster up, {summary['slice']['speedup']:g}x: SLO TTFT {slo['ttft_s']} s, "
                 f"TPOT {slo['tpot_s']} s "
                 f"({len({r['round'] for r in runs})} rounds; dots = rounds)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_table(summary: dict) -> str:
    """One row per split: goodput per round and mean, attainment, TTFT/TPOT (means over rounds), the decode
    workers' live step time, the most throttled worker group's share of periods, and the load at each start."""
    formula = tuple(summary["formula"][k] for k in ("prefill", "decode"))
    lines = ["| split | goodput per round (req/s) | mean | within SLO | TTFT p50 (s) | TPOT p50 / p99 (s) "
             "| decode step live (ms) | most throttled worker | load1 |", "|---|---|---|---|---|---|---|---|---|"]
    for p, d in (tuple(s) for s in summary["splits"]):
        rs = [r for r in summary["runs"] if (r["prefill"], r["decode"]) == (p, d)]
        if not rs:
            continue

        def mean(k: str, rs: list[dict] = rs) -> float:
            return sum(r[k] or 0.0 for r in rs) / len(rs)

        name = f"{p}:{d}" + (" colocated" if p == 0 else "") + (" **(formula)**" if (p, d) == formula else "")
        if formula[0] == 0 and [p, d] == list(summary["formula"].get("disaggregated") or []):
            name += " (formula's ratio alone)"
        per = " / ".join(f"{r['goodput_rps']:.2f}" for r in rs)
        load = " / ".join(f"{r['load1_before']:.0f}" for r in rs)
        steps = [j for r in rs if (j := r.get("decode_step_seconds_live")) is not None]
        step = " / ".join(f"{1000 * j:.0f}" for j in steps) or "–"
        shares = [v for r in rs for g, v in (r.get("throttled") or {}).items() if g != "router" and v is not None]
        thr = f"{100 * max(shares):.0f} %" if shares else "–"
        lines.append(f"| {name} | {per} | {mean('goodput_rps'):.2f} | {100 * mean('attainment'):.0f} % "
                     f"| {mean('ttft_p50_s'):.1f} | {mean('tpot_p50_s'):.2f} / {mean('tpot_p99_s'):.2f} | {step} "
                     f"| {thr} | {load} |")
    return "\n".join(lines)


def chosen_splits(args: argparse.Namespace) -> list[tuple[int, int]]:
    every = rp.splits(args.workers, colocated=not args.no_colocated)
    if not args.splits:
        return every
    want = [tuple(int(x) for x in s.split(":")) for s in args.splits.split(",")]
    bad = [s for s in want if s not in every]
    if bad:
        raise ValueError(f"--splits {bad} are not splits of {args.workers} workers")
    return want  # type: ignore[return-value]


def write_summary(args: argparse.Namespace, s: dict, span: float, todo: list[tuple[int, int]], cap: dict,
                  runs: list[dict], complete: bool) -> dict:
    """DIR/summary.json (and the plot once the formula's split has a run) from the runs so far; `complete`
    False while the sweep is still going (or when it was stopped before its last round)."""
    f = rp.formula_split(args.workers, s["mean_input_tokens"], s["mean_output_tokens"],
                         cap["prefill_tokens_per_second"], cap["decode_tokens_per_second"],
                         cap.get("decode_join_seconds") or 0.0, slo_tpot=args.slo_tpot)
    f0 = rp.formula_split(args.workers, s["mean_input_tokens"], s["mean_output_tokens"],
                          cap["prefill_tokens_per_second"], cap["decode_tokens_per_second"])
    key = lambda sp: f"{sp[0]}:{sp[1]}"  # noqa: E731
    summary = {"trace": str(args.trace), "slice": {"start_s": args.start, "duration_s": args.duration,
                                                   "speedup": args.speedup, "replayed_span_s": span,
                                                   "max_model_len": args.max_model_len, **s},
               "workers": args.workers, "rounds": args.rounds, "complete": complete,
               "kv_transfer_backend": args.kv_transfer_backend,
               "threads_per_worker": args.threads,
               "cpu_limit": {"worker": args.worker_cpu, "router": args.router_cpu} if args.worker_cpu else None,
               "splits": todo, "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot}, "capacity": cap,
               "formula": {"prefill": f.prefill, "decode": f.decode, "ratio_d_over_p": f.ratio,
                           "prefill_seconds": f.prefill_seconds, "decode_seconds": f.decode_seconds,
                           "ideal_prefill": f.ideal_prefill, "decode_join_seconds": f.decode_join_seconds,
                           "colocate": f.colocate, "rule": f.rule, "disaggregated": f.disaggregated,
                           "without_join": {"prefill": f0.prefill, "decode": f0.decode,
                                            "ideal_prefill": f0.ideal_prefill}}, "runs": runs}
    if any((r["prefill"], r["decode"]) == (f.prefill, f.decode) for r in runs):
        v = rp.verdict((((r["prefill"], r["decode"]), r["goodput_rps"]) for r in runs), (f.prefill, f.decode))
        summary["verdict"] = {"mean_goodput_rps": {key(k): g for k, g in v.mean_goodput.items()},
                              "best": v.best, "formula": v.formula,
                              "formula_share_of_best": v.formula_share_of_best, "met": v.met,
                              "disaggregated_share_of_best_disaggregated": rp.share_of_best(
                                  v.mean_goodput, f.disaggregated or (f.prefill, f.decode),
                                  [k for k in v.mean_goodput if k[0] > 0])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    if "verdict" in summary:
        plot(summary, args.out / "goodput.png")
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (timeout, kill) unwinds like Ctrl-C, so every stack is stopped and every cgroup removed.
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    try:
        todo = chosen_splits(args)
        sl = load_slice(args.trace, args.start, args.duration, args.max_model_len, args.max_output_tokens)
        cpu_limit(args)
        if args.worker_cpu:
            cpu_limits.CpuGroups().close()  # a host where the limits cannot be set fails now, not after a profile
    except (ValueError, cpu_limits.CgroupError) as e:
        print(f"ratio_sweep: {e}", file=sys.stderr)
        return 2
    s = tr.summarize(sl)
    scanned: list[dict] = []
    if args.scan_speedups:
        args.speedup, scanned = scan(args)
        print(f"rate scan: {[(r['speedup'], round(r['attainment'], 3)) for r in scanned]} -> {args.speedup}x",
              flush=True)
    span = args.duration / args.speedup
    if args.prefill_capacity and args.decode_capacity:
        cap = {"prefill_tokens_per_second": args.prefill_capacity,
               "decode_tokens_per_second": args.decode_capacity, "decode_join_seconds": None, "source": "given"}
    else:
        # the 1:1 pair is 2 of the budget's N workers: it gets that share of the sweep's arrivals
        rate = None if args.no_stream_profile else s["requests"] / span * 2 / args.workers
        cap = measure_capacity(args, rate, (s["mean_input_tokens"], s["mean_output_tokens"]))
    if args.decode_join_seconds is not None:
        cap["decode_join_seconds"] = args.decode_join_seconds
    cap["rate_scan"] = [{k: r[k] for k in ("speedup", "attainment", "goodput_rps", "ttft_p50_s", "tpot_p50_s",
                                           "uptime_before")} for r in scanned]
    print(f"capacities: {cap}", flush=True)
    runs: list[dict] = []
    for rnd in range(args.rounds):
        # Interleaved, the order turned around every other round: drift in the machine's load hits all splits.
        for i, split in enumerate(todo if rnd % 2 == 0 else list(reversed(todo))):
            runs.append(one_run(args, split, rnd, args.port + 10 * (i % 4), span))
            write_summary(args, s, span, todo, cap, runs, complete=False)  # a stopped sweep keeps what it ran
    summary = write_summary(args, s, span, todo, cap, runs, complete=True)
    if "verdict" in summary:
        print(json.dumps(summary["verdict"], indent=1))
        print(markdown_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
