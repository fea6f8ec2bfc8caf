"""A trace slice with a rise and a fall replayed through `pdcluster up --autoscale`: the replica timeline
(healthy prefill and decode workers behind the router, sampled every second) against the load, the
autoscaler's own events, and every failed request, with those in flight when a worker was stopped named.

    python -m benchmarks.autoscale_replay --trace ../shared/traces/azure2023_code.csv --out DIR

`up --autoscale` runs the operator's `decide`; its scale-down stabilization (the CRD's 300 s) is shortened
with `up --scale-down-stabilization` (default here 30 s) so a time-scaled slice can show the fall.
Writes DIR/autoscale.json and DIR/autoscale.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from benchmarks import local_stack
from benchmarks.ratio_plan import goodput
from benchmarks.ratio_sweep import add_common, load_slice
from pdcluster.bench import trace as tr


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.autoscale_replay", description=__doc__.split("\n")[0])
    add_common(p)
    p.set_defaults(max_model_len=512, port=18700)
    p.add_argument("--start", type=float, default=2160.0, help="slice start in the trace (seconds)")
    p.add_argument("--duration", type=float, default=240.0, help="slice length in trace seconds")
    p.add_argument("--speedup", type=float, default=0.8, help="< 1: slower than the trace (a busy 2-core machine)")
    p.add_argument("--max-workers", type=int, default=3, help="per pool")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between autoscaler decisions")
    p.add_argument("--stabilization", type=float, default=30.0, help="scale-down stabilization, seconds")
    p.add_argument("--tail", type=float, default=60.0, help="keep watching this long after the replay")
    p.add_argument("--prefill-capacity", type=float, default=None, help="prompt tok/s per instance (profile)")
    p.add_argument("--decode-capacity", type=float, default=None, help="output tok/s per instance (profile)")
    p.add_argument("--capacity-from", type=Path, default=None,
                   help="take both capacities from a ratio sweep's summary.json (measured by profile)")
    p.add_argument("--slo-ttft", type=float, default=5.0)
    p.add_argument("--slo-tpot", type=float, default=0.5)
    args = p.parse_args(argv)
    if args.capacity_from is not None:
        cap = json.loads(args.capacity_from.read_text())["capacity"]
        args.prefill_capacity = args.prefill_capacity or cap["prefill_tokens_per_second"]
        args.decode_capacity = args.decode_capacity or cap["decode_tokens_per_second"]
    if not (args.prefill_capacity and args.decode_capacity):
        p.error("give --prefill-capacity and --decode-capacity, or --capacity-from SUMMARY")
    return args


def stop_events(events: Sequence[Mapping[str, object]]) -> list[float]:
    """Times (monotonic) at which the autoscaler stopped a worker."""
    return [float(e["t"]) for e in events if "autoscale: stopped" in str(e["line"])]  # type: ignore[arg-type]


def failed_during_scale_down(records: Sequence[Mapping[str, object]], stops: Sequence[float],
                             grace: float = 15.0) -> list[Mapping[str, object]]:
    """Failed requests in flight (sent before, not finished until) within `grace` s of a worker's stop:
    the ones a scale-down could have lost. `start` and `latency` are on the monotonic clock."""
    out = []
    for r in records:
        if r.get("ok"):
            continue
        t0 = float(r.get("start") or 0.0)  # type: ignore[arg-type]
        t1 = t0 + float(r.get("latency") or 0.0)  # type: ignore[arg-type]
        if any(t0 - grace <= s <= t1 + grace for s in stops):
            out.append(r)
    return out


def in_flight_before(records: Sequence[Mapping[str, object]], t: float, window: float = 10.0) -> int:
    """Requests in flight at some moment of [t - window, t]: `up` prints "stopped" after the worker's drain
    (SIGTERM, at most 10 s), so these are the requests a stop could have hit."""
    n = 0
    for r in records:
        t0 = float(r.get("start") or 0.0)  # type: ignore[arg-type]
        if t0 <= t and t0 + float(r.get("latency") or 0.0) >= t - window:  # type: ignore[arg-type]
            n += 1
    return n


def arrivals_per_bin(trace: tr.Trace, bin_s: float) -> list[int]:
    n = int(trace.duration_s // bin_s) + 1
    counts = [0] * n
    for r in trace.requests:
        counts[int(r.t // bin_s)] += 1
    return counts


class Watcher(threading.Thread):
    """Samples the router's /cluster every second and picks up `up`'s autoscale lines as they appear."""

    def __init__(self, router: str, log: Path) -> None:
        super().__init__(daemon=True)
        self.router, self.log = router, log
        self.samples: list[dict] = []
        self.events: list[dict] = []
        self.done = threading.Event()

    def run(self) -> None:
        seen = 0
        while not self.done.is_set():
            now = time.monotonic()
            p, d = local_stack.healthy(local_stack.cluster_view(self.router))
            self.samples.append({"t": now, "prefill": p, "decode": d})
            lines = self.log.read_text(errors="replace").splitlines()
            for line in lines[seen:]:
                if "autoscale:" in line:
                    self.events.append({"t": now, "line": line.strip()})
            seen = len(lines)
            self.done.wait(1.0)


def plot(result: dict, trace: tr.Trace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = result["replay_t0"]
    xs = [s["t"] - t0 for s in result["samples"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.step(xs, [s["prefill"] for s in result["samples"]], where="post", label="prefill (healthy)", color="tab:blue")
    ax.step(xs, [s["decode"] for s in result["samples"]], where="post", label="decode (healthy)", color="tab:green")
    for s in result["stops"]:
        ax.axvline(s - t0, color="gray", ls=":", lw=1)
    ax.set_xlabel("seconds since the replay began (dotted: a worker stopped)")
    ax.set_ylabel("workers")
    ax2 = ax.twinx()
    bins = arrivals_per_bin(trace, 5.0)
    ax2.bar([5.0 * i for i in range(len(bins))], [b / 5.0 for b in bins], width=5.0, align="edge",
            color="tab:orange", alpha=0.3, label="arrivals (req/s, 5 s bins)")
    ax2.set_ylabel("requests/s")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper right")
    c = result["counts"]
    ax.set_title(f"pdcluster up --autoscale: {c['requests']} requests, {c['failed']} failed, "
                 f"{c['failed_during_scale_down']} failed around a scale-down", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        sl = load_slice(args.trace, args.start, args.duration, args.max_model_len)
    except ValueError as e:
        print(f"autoscale_replay: {e}", file=sys.stderr)
        return 2
    scaled = tr.scale_time(sl, args.speedup)
    work = args.work / "autoscale"
    work.mkdir(parents=True, exist_ok=True)
    flags = ["--autoscale", "--prefill", "1", "--decode", "1", "--max-workers", str(args.max_workers),
             "--autoscale-interval", str(args.interval), "--scale-down-stabilization", str(args.stabilization),
             "--prefill-capacity", str(args.prefill_capacity), "--decode-capacity", str(args.decode_capacity),
             "--threads", str(args.threads), "--max-queue-depth", "1024"]
    log = work / "up.log"
    with local_stack.up(flags, args.port, log, (1, 1)) as router:
        local_stack.warm_up(router, work / "warmup")
        w = Watcher(router, log)
        w.start()
        t0 = time.monotonic()
        recs = local_stack.replay(router, args.trace, work / "replay", start=args.start, duration=args.duration,
                                  speedup=args.speedup, max_model_len=args.max_model_len)
        time.sleep(args.tail)
        w.done.set()
        w.join()
    # The replay's own clock origin (its first send is at trace offset t): arrivals and samples line up.
    t0 = min((float(r["start"]) - float(r["t"]) for r in recs if r.get("start")), default=t0)
    stops = stop_events(w.events)
    lost = failed_during_scale_down(recs, stops)
    counts = {**goodput(recs, args.slo_ttft, args.slo_tpot, scaled.duration_s or 1.0),
              "failed_during_scale_down": len(lost),
              "in_flight_at_each_stop": [in_flight_before(recs, t) for t in stops],
              "errors": sorted({str(r.get("error")) for r in recs if not r.get("ok")}),
              "max_prefill": max(s["prefill"] for s in w.samples), "max_decode": max(s["decode"] for s in w.samples),
              "scale_ups": sum("autoscale: started" in e["line"] for e in w.events), "scale_downs": len(stops)}
    result = {"trace": str(args.trace), "slice": {"start_s": args.start, "duration_s": args.duration,
                                                  "speedup": args.speedup, **tr.summarize(sl)},
              "up_flags": flags, "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot}, "counts": counts,
              "replay_t0": t0, "stops": stops, "events": w.events, "samples": w.samples}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "autoscale.json").write_text(json.dumps(result, indent=1))
    plot(result, scaled, args.out / "autoscale.png")
    print(json.dumps(counts, indent=1))
    return 0 if counts["failed_during_scale_down"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
