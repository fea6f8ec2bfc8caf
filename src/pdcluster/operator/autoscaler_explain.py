"""Pure: why each pool of a decision has its size, in a small fixed vocabulary.

`decide` returns a reason for the decision as a whole (`ScaleUp`, `Stabilizing`, ...). A scaling step
is explained per pool by its **cause**, the rule that set the number:

| cause | the pool's size came from |
|---|---|
| `formula` | the need at the mean rate with headroom (`h·λ·work`), or the formula agrees with the size held |
| `burst` | the peak (burst-window) rate, or a remembered burst holding the pool up |
| `tail` | prefill only: the instances a heavy tail of prompt lengths needs for the TTFT target (`autoscaler_tail`), above the formula's |
| `slo-guard` | an observed percentile over `spec.autoscaling.slo` with a queue in front of the pool |
| `flip` | workers changing role (`spec.roleFlips`, `autoscaler_flip.applied`, or on a short window: `autoscaler_flip_window`): the pool grew or shrank by them |
| `bound` | `minReplicas`/`maxReplicas` or `spec.autoscaling.ratio` |
| `stabilization` | a scale-down held or slowed by `scaleDownStabilizationSeconds` (the window's highest need), or a formula scale-up the trusted short window does not ask for (`ScaleUpUnconfirmed`) |
| `limit` | `maxScaleUpStep`/`maxScaleDownStep`, `maxTotalReplicas`, or a stalled rollout |
| `hold` | no decision possible: metrics or capacity unknown, or a rollout in progress |

The causes go to the Scaled Event's message, to `status.autoscaler.lastDecision` (per pool `cause`, and a
`message`), and to the `cause` label of `pdcluster_autoscaler_scaling_steps_total`.
"""

from __future__ import annotations

from pdcluster.operator import autoscaler as asc
from pdcluster.operator.autoscaler_flip import FLIP, FLIP_WINDOW
from pdcluster.operator.planner import replicas_for

CAUSES = ("formula", "burst", "tail", "slo-guard", "flip", "bound", "stabilization", "limit", "hold")
_HOLDS = {asc.METRICS_UNAVAILABLE, asc.CAPACITY_UNKNOWN, asc.ROLLOUT, asc.DISABLED}


def _held_by_burst(d: asc.Decision, role: str) -> bool:
    """A size held above the recommendation by the burst memory rather than the need window."""
    ps = d.state.pool(role)
    bursts = max((n for _, n in ps.recent_bursts), default=0.0)
    window = max((n for _, n in ps.recent_needs), default=0.0)
    return bursts > window and replicas_for(bursts * (1 + asc.DOWN_TOLERANCE)) >= d.pool(role).desired


def pool_cause(d: asc.Decision, role: str) -> str:
    p = d.pool(role)
    i = d.inputs
    if d.reason in (FLIP, FLIP_WINDOW) and p.desired != p.current:
        return "flip"
    if p.reason == asc.RATIO_BOUND:
        return "bound"
    if p.reason == asc.SLO_GUARD:
        return "slo-guard"
    if p.reason in _HOLDS:
        return "limit" if p.rollout_stalled else "hold"
    if f"max-{role}" in d.limited_by and p.recommended is not None and p.desired == p.recommended:
        return "bound"  # the formula asked for more than maxReplicas
    rec = p.recommended if p.recommended is not None else p.current
    if p.desired > p.current:
        step = i.get("maxScaleUpStep")
        if p.desired < rec and step is not None and p.desired == p.current + step:
            return "limit"
        if "max-total-replicas" in d.limited_by:
            return "limit"
        burst, need, tail = i.get(f"{role}BurstNeed"), i.get(f"{role}Need"), i.get(f"{role}TailNeed")
        if need is not None and tail is not None and tail >= need and (burst is None or tail > burst):
            return "tail"
        return "burst" if burst is not None and need is not None and burst >= need else "formula"
    if p.desired < p.current:
        step = i.get("maxScaleDownStep")
        if p.desired > rec and step is not None and p.desired == p.current - step:
            return "limit"
        if p.desired > rec:
            return "burst" if _held_by_burst(d, role) else "stabilization"
        return "formula"
    # held at its size (a scale-up the short window did not ask for is held as HPA's scale-up stabilization holds)
    if p.reason in (asc.STABILIZING, asc.NO_HEADROOM, asc.UNCONFIRMED):
        return "burst" if p.reason == asc.NO_HEADROOM and _held_by_burst(d, role) else "stabilization"
    return "formula"


def causes(d: asc.Decision) -> dict[str, str]:
    return {r: pool_cause(d, r) for r in asc.POOLS}


def message(d: asc.Decision) -> str:
    """One line: each pool's step and cause, e.g. `prefill 3->5 (burst), decode 2->2 (formula)`."""
    c = causes(d)
    parts = [f"{r} {d.pool(r).current}->{d.pool(r).desired} ({c[r]})" for r in asc.POOLS]
    limits = f"; limited by {', '.join(d.limited_by)}" if d.limited_by else ""
    return f"{', '.join(parts)}: {d.reason}{limits}"


def window_inputs(d: asc.Decision) -> str:
    """What a short-window flip step (`RoleFlipShortWindow`) read: the operator's Scaled Event and `up`'s log."""
    i = d.inputs

    def f(x: float | None, unit: str = "") -> str:
        return "n/a" if x is None else f"{x:.4g}{unit}"

    return (f"last {i['flipWindowSeconds']:g} s: rate {f(i['requestRate'], ' req/s')}, "
            f"I {f(i['meanInputTokens'])}, O {f(i['meanOutputTokens'])} "
            f"(by completion {f(i['finishedOutputTokens'])}), need prefill {f(i['prefillWindowNeed'])}, decode {f(i['decodeWindowNeed'])}")
