"""Pure: role flips on short-window evidence (`spec.autoscaling.flipWindowSeconds`, default 20 s).

`decide` reads `windowSeconds` (120 s) every `intervalSeconds` (30 s): when the load's mix turns (prompts
give way to long outputs) it sees the new mix one to two windows late, since its I and O are means over two
minutes that are mostly the old mix. A pod order has to wait for that evidence (a pod costs a pod start and
stays a stabilization period), but a flip costs seconds and no pod, and the next flip undoes it: so flips
may act on a shorter window. Every `period` (a quarter of the window, 5 s at least; between decisions and on a
decision's tick when it changed nothing) this step reads the last `flipWindowSeconds` of rate, I and O
and the queue gauges, and moves running workers between the pools toward the split that window asks for:

- **enough evidence**: the window holds at least `MIN_REQUESTS` (30) requests, λ·window (a mean of 30
  draws of a heavy-tailed length is within ±20-40 % of its true mean; fewer and one long prompt flips a
  worker), and nothing is in flight (every pool has `ready >= current`: a rollout or an earlier flip);
- **fresh evidence**: the window began after each pool's last change was seen ready (`ready_at`, else
  its `last_change`): a window half before and half after a flip describes neither pool as it is;
- **the split**: per pool `λ·work + queue·work/window` (work = I'/C_p, O/C_d + t_join at the
  capacities `decide` uses, SLO correction included; the queue the pool's gauge at the window's end, worked
  off within one window). No headroom: headroom provisions for load that moves faster than pods start, and
  a flip follows the load in seconds, re-read every quarter window; with `decide`'s headroom (1.5 on bursty
  load) a 20 s window of Mooncake conversation read 1.13 decode instances for a pool of 1 and flipped 4-5
  prefill workers away that the burst memory held (96.28 % -> 96.18 %, dominated). A pool is **short**
  when `ceil(need)` exceeds its size, and the other has **slack** above `keep`: `ceil(need·(1 +
  DOWN_TOLERANCE))`, its minimum at least. Not above the last (long-window) recommendation: after a turn of
  the mix that is the stale belief this step exists to overtake; but a pool without one (metrics or
  capacity unknown) has no slack;
- **O by completion**: O is the mean length of the requests that *finished* in the window (the router's
  `pdcluster_request_generation_tokens`, vLLM's `vllm:request_generation_tokens`), not `decide`'s tokens
  generated per request admitted. That ratio lags a turn toward long answers by the answers' length (a
  900-token answer is generated over many seconds after its request was admitted: 20 s after the turn of
  shift seed 5 it read O = 265 against a true 890, and a decode pool at full batch caps it at C_d·n/λ), and
  overshoots once the backlog drains (1,009-1,356 against ~900); the finished requests' mean read 650 and
  838 at 20 and 30 s, and stays within ~5 % after. Shift traces cold: -0.4 to -3.6 points against the oracle
  before, -0.2 to -2.3 after, at the same or fewer instance-hours (docs/benchmarks/autoscaler.md).
- **never pods**: the total of the pools is unchanged; flips = min(short, slack), within
  `maxScaleUpStep`, the replica bounds and `spec.autoscaling.ratio` (fewer until it holds);
- **hysteresis**: the giving pool keeps the 10 % margin of scale-down (`DOWN_TOLERANCE`), and the next flip
  needs a whole fresh window after this one is ready (the freshness rule): a flip back needs a window
  that, entirely after this flip, asks for the other split. `decide`'s own flips take no pool below what a
  trusted short window asks it to keep (`autoscaler_flip.plan`'s `keep`), so the long window cannot flip
  back what this step moved while its mean still holds the old mix.

The decision it returns counts as a change of both pools (their `last_change`: `decide` waits for the flip
to be ready, scale-down stabilization restarts); its reason is `RoleFlipShortWindow` (cause `flip`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from pdcluster.operator import autoscaler as asc
from pdcluster.operator import autoscaler_guard as slo_guard
from pdcluster.operator.autoscaler_flip import FLIP_WINDOW
from pdcluster.operator.planner import replicas_for

MIN_REQUESTS = 30  # requests a window must hold before its mix is trusted (module docstring)


def period(window_seconds: float) -> float:
    """How often the step runs: every quarter window (5 s at least: the router's scrape interval in the chart),
    so a turn of the mix is read within a quarter window of the window being full of it. Half the window (10 s)
    left a primed start meeting the other mix 5 s longer on the wrong split: 0.2 to 2 points on every shift
    trace primed without aggregation (docs/benchmarks/autoscaler.md)."""
    return max(5.0, window_seconds / 4)


def last_recommended(autoscaler_status: Mapping[str, Any]) -> dict[str, int | None]:
    """The recommendation per pool of the last decision recorded in `status.autoscaler`
    (`status.decision_record`); None for a pool without one (or junk), {} without a decision."""
    last = autoscaler_status.get("lastDecision") if isinstance(autoscaler_status, Mapping) else None
    if not isinstance(last, Mapping):
        return {}
    rec: dict[str, int | None] = {}
    for r in asc.POOLS:
        p = last.get(r)
        v = p.get("recommended") if isinstance(p, Mapping) else None
        rec[r] = v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None
    return rec


def by_completion(obs: asc.Observation) -> asc.Observation:
    """`obs` with O by completion where the window saw requests finish (module docstring, "O")."""
    fin = obs.finished_output_tokens
    if fin is None or not math.isfinite(fin) or fin <= 0:
        return obs
    return replace(obs, mean_output_tokens=fin)


@dataclass(frozen=True)
class ShortNeeds:
    """What the short window asks of each pool: the unrounded need and the sizes it implies."""

    need: dict[str, float]
    short: dict[str, int]  # ceil(need) within the pool's bounds
    keep: dict[str, int]  # what a giving pool keeps: ceil(need·(1+margin)), its minimum at least


def short_needs(policy: asc.Policy, state: asc.State, obs: asc.Observation | None, window_seconds: float,
                min_requests: int = MIN_REQUESTS) -> ShortNeeds | None:
    """The needs of the short window `obs`, or None when it cannot be trusted (the window off, too few
    requests, a length or a capacity unknown)."""
    if obs is None or obs.request_rate is None or window_seconds <= 0:
        return None
    rate = obs.request_rate
    if rate * window_seconds < min_requests:
        return None
    obs = by_completion(obs)
    need: dict[str, float] = {}
    for r in asc.POOLS:
        w = slo_guard.work(policy, obs, state.pool(r), r)
        if w is None or not math.isfinite(w):
            return None
        # the window's mean demand, and the backlog at its end worked off within one window
        need[r] = rate * w + (slo_guard.queue_now(obs, r) or 0.0) * w / window_seconds
    short = {r: policy.bounds.clamp(r, replicas_for(need[r])) for r in asc.POOLS}
    keep = {r: max(policy.bounds.of(r)[0], replicas_for(need[r] * (1 + asc.DOWN_TOLERANCE))) for r in asc.POOLS}
    return ShortNeeds(need, short, keep)


def need(policy: asc.Policy, state: asc.State, obs: asc.Observation | None, window_seconds: float
         ) -> dict[str, float] | None:
    """What a decision's formula scale-up must exceed, with its headroom (`decide`'s `short_need`): the trusted
    short window's need per pool; None with the window off (0) or not to be trusted."""
    sn = short_needs(policy, state, obs, window_seconds)
    return sn.need if sn is not None else None


def keep(policy: asc.Policy, state: asc.State, obs: asc.Observation | None, window_seconds: float
         ) -> dict[str, int] | None:
    """What a decision's own flips leave each pool (`autoscaler_flip.plan`'s `keep`): the trusted short
    window's `keep`; None (no floor) with the window off (0) or not to be trusted."""
    sn = short_needs(policy, state, obs, window_seconds)
    return sn.keep if sn is not None else None


def _fresh(ps: asc.PoolState, now: float, window_seconds: float) -> bool:
    ref = ps.ready_at if ps.ready_at is not None else ps.last_change
    return ref is None or now - ref >= window_seconds - 1e-9


def window_flips(policy: asc.Policy, state: asc.State, obs: asc.Observation | None, prefill: asc.PoolView,
                 decode: asc.PoolView, now: float, *, window_seconds: float,
                 recommended: Mapping[str, int | None] | None = None,
                 min_requests: int = MIN_REQUESTS) -> asc.Decision | None:
    """The flip-only decision of the short window `obs` (of `window_seconds`), or None to leave the pools
    (module docstring). `recommended`: the last decision's recommendation per pool."""
    views = {"prefill": prefill, "decode": decode}
    if any(v.ready < v.current for v in views.values()):
        return None
    pool_states = {r: slo_guard.note_ready(state.pool(r), views[r], now) for r in asc.POOLS}
    if not all(_fresh(pool_states[r], now, window_seconds) for r in asc.POOLS):
        return None
    sn = short_needs(policy, state, obs, window_seconds, min_requests)
    if sn is None or obs is None:
        return None
    rec = recommended or {}
    for grow, give in (("prefill", "decode"), ("decode", "prefill")):
        short = sn.short[grow] - views[grow].current
        # no recommendation: metrics or capacity unknown, so no slack (as in autoscaler_flip.slack)
        floor_ = sn.keep[give] if rec.get(give) is not None else views[give].current
        n = min(short, views[give].current - floor_, policy.max_up_step)
        _, hi = policy.bounds.of(grow)
        if hi is not None:
            n = min(n, hi - views[grow].current)
        while n > 0:
            sizes = {grow: views[grow].current + n, give: views[give].current - n}
            if policy.ratio.holds(sizes["prefill"], sizes["decode"]):
                break
            n -= 1
        if n <= 0:
            continue
        out = {grow: asc.PoolDecision(views[grow].current, sn.short[grow], views[grow].current + n, FLIP_WINDOW,
                                      None, "unknown"),
               give: asc.PoolDecision(views[give].current, sn.keep[give], views[give].current - n, FLIP_WINDOW,
                                      None, "unknown")}
        for r in asc.POOLS:
            pool_states[r] = replace(pool_states[r], last_change=now, below_since=None)
        inputs = {"flipWindowSeconds": window_seconds,
                  "windowRequests": round((obs.request_rate or 0.0) * window_seconds, 1),
                  "requestRate": obs.request_rate, "meanInputTokens": obs.mean_input_tokens,
                  "meanOutputTokens": obs.mean_output_tokens,
                  "finishedOutputTokens": obs.finished_output_tokens,
                  "prefillWindowNeed": sn.need["prefill"], "decodeWindowNeed": sn.need["decode"],
                  "maxScaleUpStep": policy.max_up_step, "maxScaleDownStep": policy.max_down_step,
                  "ratioMin": policy.ratio.min, "ratioMax": policy.ratio.max}
        return asc.Decision(prefill=out["prefill"], decode=out["decode"], reason=FLIP_WINDOW, limited_by=[],
                            inputs=inputs, state=asc.State(prefill=pool_states["prefill"], decode=pool_states["decode"]),
                            metrics_available=True)
    return None
