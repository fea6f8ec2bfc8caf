"""Per-policy figures from a run, the summary.json document, and the plots (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

from pdcluster.bench.sim.cluster import RunResult
from pdcluster.bench.sim.model import SLO
from pdcluster.bench.trace import Trace, percentile


def request_outcomes(r: RunResult, slo: SLO) -> tuple[list[float], list[float], list[bool]]:
    """(TTFTs, TPOTs of served requests, met-SLO flag per request). Rejected/unfinished = missed."""
    ttfts: list[float] = []
    tpots: list[float] = []
    met: list[bool] = []
    for i, a in enumerate(r.arrival):
        f, d = r.first_token[i], r.done[i]
        if r.rejected[i] or f is None or d is None:
            met.append(False)
            continue
        ttft = f - a
        tpot = (d - f) / (r.output_tokens[i] - 1) if r.output_tokens[i] > 1 else 0.0
        ttfts.append(ttft)
        if r.output_tokens[i] > 1:
            tpots.append(tpot)
        met.append(ttft <= slo.ttft_s and tpot <= slo.tpot_s)
    return ttfts, tpots, met


def attainment(r: RunResult, slo: SLO) -> float:
    met = request_outcomes(r, slo)[2]
    return sum(met) / len(met) if met else 0.0


def policy_summary(r: RunResult, slo: SLO, feasible: tuple[bool, ...] | None = None) -> dict:
    """The policy's figures; with `feasible` (per request, `feasibility.py`), attainment over those too."""
    ttfts, tpots, met = request_outcomes(r, slo)
    out_feasible = [m for m, f in zip(met, feasible, strict=True) if f] if feasible is not None else met
    return {
        "slo_attainment": sum(met) / len(met) if met else 0.0,
        "slo_attainment_feasible": sum(out_feasible) / len(out_feasible) if out_feasible else 0.0,
        "ttft_p99_s": percentile(ttfts, 99),
        "tpot_p99_s": percentile(tpots, 99),
        "instance_hours": r.prefill_instance_hours + r.decode_instance_hours,
        "prefill_instance_hours": r.prefill_instance_hours,
        "decode_instance_hours": r.decode_instance_hours,
        "scale_events": r.scale_events,
        "max_prefill": r.max_prefill,
        "max_decode": r.max_decode,
        "rejected": sum(r.rejected),
        "role_flips": r.flips,
        "aggregated_requests": r.aggregated,
        "scaling_steps_by_cause": dict(sorted(r.steps_by_cause.items())),
        "prefix_hit_rate": r.prefix_hit_tokens / r.prefilled_tokens if r.prefilled_tokens else 0.0,
    }


def trace_summary(trace: Trace) -> dict:
    n = len(trace.requests)
    return {
        "requests": n,
        "duration_s": trace.duration_s,
        "mean_input_tokens": sum(x.input_tokens for x in trace.requests) / n,
        "mean_output_tokens": sum(x.output_tokens for x in trace.requests) / n,
    }


def goal_check(policies: dict[str, dict], target: float) -> dict | None:
    """The issue's goal for `pdcluster`, when the needed policies ran."""
    if not {"pdcluster", "static-best"} <= policies.keys():
        return None
    pd, best = policies["pdcluster"], policies["static-best"]
    cost = pd["instance_hours"] / best["instance_hours"] if best["instance_hours"] else None
    out = {"target_attainment": target, "pdcluster_attainment": pd["slo_attainment"],
           "cost_vs_static_best": cost,
           "met_attainment": pd["slo_attainment"] >= target,
           "met_cost": cost is not None and cost <= 1.2}
    for other in ("no-headroom", "independent", "keda-tokens"):
        if other in policies:
            out[f"beats_{other.replace('-', '_')}"] = pd["slo_attainment"] > policies[other]["slo_attainment"]
    out["dominated_by"] = dominated_by(policies, "pdcluster")
    if "reactive-oracle" in policies:
        out["points_below_reactive_oracle"] = 100 * (policies["reactive-oracle"]["slo_attainment"]
                                                     - pd["slo_attainment"])
    out["points_below_static_best"] = 100 * (best["slo_attainment"] - pd["slo_attainment"])
    return out


def dominated_by(policies: dict[str, dict], name: str) -> list[str]:
    """The policies both within SLO more often than `name` and cheaper (instance-hours) than it."""
    me = policies[name]
    return [n for n, p in policies.items() if n != name and p["slo_attainment"] > me["slo_attainment"]
            and p["instance_hours"] < me["instance_hours"]]


def _load_per_minute(trace: Trace) -> tuple[list[float], list[float]]:
    buckets: dict[int, int] = {}
    for r in trace.requests:
        buckets[int(r.t // 60)] = buckets.get(int(r.t // 60), 0) + 1
    xs = list(range(int(trace.duration_s // 60) + 1))
    return [x + 0.5 for x in xs], [buckets.get(x, 0) / 60.0 for x in xs]


def plot_replicas(trace: Trace, runs: dict[str, RunResult], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in runs if not n.startswith("static-")] or list(runs)
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 2.2 * len(names) + 0.6), sharex=True, squeeze=False)
    mx, my = _load_per_minute(trace)
    for ax, name in zip(axes[:, 0], names, strict=True):
        tl = runs[name].timeline
        ts = [t[0] / 60 for t in tl]
        ax.step(ts, [t[1] for t in tl], where="post", label="P (prefill)", color="tab:blue")
        ax.step(ts, [t[2] for t in tl], where="post", label="D (decode)", color="tab:orange")
        ax.set_ylabel(f"{name}\nreplicas")
        ax2 = ax.twinx()
        ax2.plot(mx, my, color="0.6", lw=0.8, label="load (req/s, per minute)")
        ax2.set_ylabel("req/s", color="0.4")
        if ax is axes[0, 0]:
            h1, l1 = ax.get_legend_handles_labels()
            h2, l2 = ax2.get_legend_handles_labels()
            ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=7)
    axes[-1, 0].set_xlabel("minutes")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_tradeoff(policies: dict[str, dict], path: Path, title: str, target: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, p in policies.items():
        ax.scatter(p["instance_hours"], 100 * p["slo_attainment"], s=40)
        ax.annotate(name, (p["instance_hours"], 100 * p["slo_attainment"]), fontsize=8,
                    xytext=(4, 4), textcoords="offset points")
    ax.axhline(100 * target, color="0.6", ls="--", lw=0.8)
    ax.set_xlabel("instance-hours")
    ax.set_ylabel("requests within SLO (%)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
