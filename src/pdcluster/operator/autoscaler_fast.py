"""Pure: the fast scale-up path between two decisions of `decide`, on instant queue gauges.

`decide` reads `windowSeconds` (120 s) of metrics every `intervalSeconds` (30 s): a burst that begins just
after one decision reaches the next one diluted in a two-minute mean, and its pods start a pod start after
that. Dynamo's planner runs a fast load loop beside its slow one for this reason. Between two decisions
this path reads what a cluster can read every few seconds without a rate window: each pool's queue gauge
(`sum(pdcluster_requests_waiting{role})`) at the last two scrapes (so it sees what Prometheus saw, a scrape
late, never the arrivals themselves) and the pools' sizes, plus one request's work from the last windowed
observation (I, O, the prefix-hit rate: minutes-scale quantities).

- It only grows a pool, and only while the pool's queue is growing and already waits longer than the TTFT
  target (`autoscaler_rules.backlog_need`); to what the queue's growth says arrivals need plus the backlog
  worked off within a window. Decode answers for TTFT here as in the SLO guard (a request waiting for a
  decode slot has no first token).
- `maxScaleUpStep`, the replica bounds, `maxTotalReplicas` and `spec.autoscaling.ratio` apply as in `decide`.
- Its step is an SLO-guard step (reason `SLOBreached`, cause `slo-guard`): a queue that waits past the TTFT
  target is the breach before the window's percentile shows it. The state it returns counts the step as the
  pool's last change: `decide` then waits for its rollout, the guard counts its window from it, and
  scale-down stabilization starts afresh.
- Without a TTFT target (`spec.autoscaling.slo.ttftSeconds`) it never acts.

The operator does not run it yet: `pdcluster simulate --fast-path S` evaluates it, off by default because it
lost points on held-out traces (docs/benchmarks/autoscaler.md, "The fast path").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from pdcluster.operator import autoscaler as asc
from pdcluster.operator import autoscaler_guard as slo_guard
from pdcluster.operator import autoscaler_ratio as ratio_bounds
from pdcluster.operator import autoscaler_rules as rules


@dataclass(frozen=True)
class Gauges:
    """One pool's queue gauge at the last two scrapes (None: the series is missing)."""

    queue_now: float | None  # requests waiting in front of the pool at the latest scrape
    queue_before: float | None  # ... at the scrape before it
    seconds: float | None  # between the two scrapes


def fast_decide(policy: asc.Policy, state: asc.State, last: asc.Observation | None, gauges: Mapping[str, Gauges],
                prefill: asc.PoolView, decode: asc.PoolView, now: float,
                recommended: Mapping[str, int | None] | None = None) -> asc.Decision | None:
    """The decision of the fast path, or None when it leaves the pools to `decide` (see the module docstring).
    `last`: the last windowed observation (one request's work: I', O); `gauges`: per role; `recommended`: the
    last decision's recommendation per pool (what the formula asks for it: a pool held above it has slack
    that `autoscaler_flip` may move to the growing pool; None: no slack)."""
    target = policy.slo_ttft_seconds
    if target is None or last is None:
        return None
    views = {"prefill": prefill, "decode": decode}
    pool_states = {r: state.pool(r) for r in asc.POOLS}
    needs: dict[str, float | None] = {}
    out: dict[str, asc.PoolDecision] = {}
    for r in asc.POOLS:
        g, v = gauges.get(r), views[r]
        pool_states[r] = slo_guard.note_ready(pool_states[r], v, now)
        work = slo_guard.work(policy, last, pool_states[r], r)
        fresh = g is not None and g.seconds is not None \
            and rules.gauges_predate(pool_states[r].ready_at, now, g.seconds)
        needs[r] = None if g is None or fresh else rules.backlog_need(
            g.queue_now, g.queue_before, g.seconds, v.ready, work, target, policy.window_seconds)
        desired = v.current
        n = needs[r]
        if n is not None and math.ceil(n - 1e-9) > v.current:
            desired = policy.bounds.clamp(r, min(math.ceil(n - 1e-9), v.current + policy.max_up_step))
        grows = desired > v.current
        out[r] = asc.PoolDecision(v.current, (recommended or {}).get(r), desired,
                                  asc.SLO_GUARD if grows else asc.STEADY, None, "unknown", slo_breached=grows)
    if not any(out[r].desired > out[r].current for r in asc.POOLS):
        return None
    limited_by: list[str] = []
    total = policy.bounds.max_total
    if total is not None and out["prefill"].desired + out["decode"].desired > total:
        limited_by.append("max-total-replicas")
        for r in asc.POOLS:  # what the budget leaves beside the other pool as it stands
            other = "decode" if r == "prefill" else "prefill"
            room = max(out[r].current, total - out[other].current)
            if out[r].desired > room:
                out[r] = replace(out[r], desired=room)
        if not any(out[r].desired > out[r].current for r in asc.POOLS):
            return None
    for r in asc.POOLS:
        if out[r].desired > out[r].current:
            ps = pool_states[r]
            pool_states[r] = replace(ps, last_change=now, below_since=None, slo_breaches=ps.slo_breaches + 1)
    _, ratio_limits = ratio_bounds.keep(policy, out, pool_states, now)
    inputs = {"fastPath": True, "ttftSeconds": target, "maxScaleUpStep": policy.max_up_step,
              "maxScaleDownStep": policy.max_down_step, "ratioMin": policy.ratio.min, "ratioMax": policy.ratio.max}
    for r in asc.POOLS:
        g = gauges.get(r)
        inputs[f"{r}QueueNow"] = g.queue_now if g else None
        inputs[f"{r}QueueBefore"] = g.queue_before if g else None
        inputs[f"{r}BacklogNeed"] = needs[r]
    return asc.Decision(prefill=out["prefill"], decode=out["decode"], reason=asc.SLO_GUARD,
                        limited_by=[*limited_by, *ratio_limits], inputs=inputs,
                        state=asc.State(prefill=pool_states["prefill"], decode=pool_states["decode"]),
                        metrics_available=True)
