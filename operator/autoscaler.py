"""The autoscaler's pure core: observations + state + policy -> a decision and the next state.

No I/O and no clock: `now` is an argument, state is a plain dataclass that the operator keeps in the
PDCluster's status (so a restarted operator neither forgets learned capacities nor restarts a
stabilization window; `status.autoscaler_state` and `status.autoscaler_status` convert). The rules:

- Recommendation per pool from the formula in `planner` (`P = ceil(h·λ·I/C_p)`, `D = ceil(h·λ·O/C_d)`),
  clamped to the pool bounds and, with `maxTotalReplicas`, scaled down together keeping the ratio.
  Zero traffic recommends the minimums.
- Capacities: `spec.autoscaling.capacity` when set; otherwise learned: the per-instance throughput
  observed while the pool was saturated (its queue non-empty across the whole window) is its capacity,
  smoothed with an EWMA; an unsaturated pool that served more than the learned capacity raises it
  (throughput is a lower bound of capacity). A pool whose capacity is unknown is held.
- Scale up at once (at most `maxScaleUpStep` per decision).
- Scale down only after recommendations stayed below the current size for
  `scaleDownStabilizationSeconds`, where "below" means that even the load plus a 10% margin
  (DOWN_TOLERANCE) fits in one replica less, i.e. the pool minus one still has headroom; the target is
  the highest load seen in that window (plus the margin), and at most `maxScaleDownStep` replicas go per
  decision.
- Wait while a previous change is still rolling out (ready < desired), but not forever: after
  `rolloutTimeoutSeconds` decide anyway and report the stall (ScalingLimited), so Pending pods (no GPU
  left) never wedge the autoscaler.
- No metrics -> hold everything.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pdcluster.operator.planner import Bounds, clamp_pair, replicas_for

EWMA_ALPHA = 0.3
# A recommendation only counts as "lower" when even the load plus 10% fits in one replica less.
DOWN_TOLERANCE = 0.10
POOLS = ("prefill", "decode")

# Reasons, also the `reason` label of pdcluster_autoscaler_decisions_total.
SCALE_UP = "ScaleUp"
SCALE_DOWN = "ScaleDown"
REBALANCE = "Rebalance"
STEADY = "Steady"
STABILIZING = "Stabilizing"
NO_HEADROOM = "NoHeadroomForScaleDown"
ROLLOUT = "RolloutInProgress"
CAPACITY_UNKNOWN = "CapacityUnknown"
METRICS_UNAVAILABLE = "MetricsUnavailable"
DISABLED = "AutoscalingDisabled"

_HOLD_PRIORITY = [METRICS_UNAVAILABLE, ROLLOUT, CAPACITY_UNKNOWN, STABILIZING, NO_HEADROOM, STEADY]


@dataclass(frozen=True)
class Observation:
    """What Prometheus said over the window. None = series missing."""

    request_rate: float | None  # λ, requests/s
    mean_input_tokens: float | None  # I
    mean_output_tokens: float | None  # O
    prefill_tokens_per_instance: float | None = None  # observed prompt tok/s per prefill instance
    decode_tokens_per_instance: float | None = None  # observed output tok/s per decode instance
    prefill_saturated: bool = False  # queue non-empty across the whole window
    decode_saturated: bool = False


@dataclass(frozen=True)
class PoolView:
    """The pool as the cluster shows it now."""

    current: int  # replicas the operator last set
    ready: int
    since: float | None = None  # when the pool last changed (e.g. Deployment creation) if state lacks it


@dataclass(frozen=True)
class Policy:
    headroom: float = 1.5
    bounds: Bounds = field(default_factory=Bounds)
    stabilization_seconds: float = 300.0
    max_up_step: int = 4
    max_down_step: int = 1
    rollout_timeout_seconds: float = 600.0
    prefill_capacity: float | None = None  # configured C_p
    decode_capacity: float | None = None  # configured C_d

    @classmethod
    def from_spec(cls, spec: Any) -> Policy:
        a = spec.autoscaling
        return cls(
            headroom=a.headroom,
            bounds=Bounds(spec.prefill.minReplicas, spec.prefill.maxReplicas, spec.decode.minReplicas,
                          spec.decode.maxReplicas, a.maxTotalReplicas),
            stabilization_seconds=a.scaleDownStabilizationSeconds,
            max_up_step=a.maxScaleUpStep,
            max_down_step=a.maxScaleDownStep,
            rollout_timeout_seconds=a.rolloutTimeoutSeconds,
            prefill_capacity=a.capacity.prefillTokensPerSecond,
            decode_capacity=a.capacity.decodeTokensPerSecond,
        )


@dataclass(frozen=True)
class PoolState:
    below_since: float | None = None  # when recommendations first fell below the current size
    max_need: float | None = None  # highest unrounded need (h·λ·len/C) since then
    last_change: float | None = None  # when the operator last changed this pool's size
    learned_capacity: float | None = None


@dataclass(frozen=True)
class State:
    prefill: PoolState = field(default_factory=PoolState)
    decode: PoolState = field(default_factory=PoolState)

    def pool(self, role: str) -> PoolState:
        return getattr(self, role)


@dataclass(frozen=True)
class PoolDecision:
    current: int
    recommended: int | None
    desired: int
    reason: str
    capacity: float | None
    capacity_source: str  # spec | learned | unknown
    rollout_stalled: bool = False


@dataclass(frozen=True)
class Decision:
    prefill: PoolDecision
    decode: PoolDecision
    reason: str
    limited_by: list[str]
    inputs: dict[str, Any]
    state: State
    metrics_available: bool

    @property
    def changed(self) -> bool:
        return self.prefill.desired != self.prefill.current or self.decode.desired != self.decode.current

    def pool(self, role: str) -> PoolDecision:
        return getattr(self, role)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("state")
        return d


def learn_capacity(previous: float | None, observed: float | None, saturated: bool,
                   alpha: float = EWMA_ALPHA) -> float | None:
    """Update a learned per-instance capacity from one window's observed throughput."""
    if observed is None or not math.isfinite(observed) or observed <= 0:
        return previous
    if saturated:
        return observed if previous is None else previous + alpha * (observed - previous)
    if previous is not None and observed > previous:
        # An unsaturated pool served more than we thought it could: capacity is at least that.
        return observed
    return previous


def _overall_reason(p: PoolDecision, d: PoolDecision) -> str:
    ups = [x for x in (p, d) if x.desired > x.current]
    downs = [x for x in (p, d) if x.desired < x.current]
    if ups and downs:
        return REBALANCE
    if ups:
        return SCALE_UP
    if downs:
        return SCALE_DOWN
    for reason in _HOLD_PRIORITY:
        if reason in (p.reason, d.reason):
            return reason
    return STEADY


def decide(policy: Policy, state: State, obs: Observation | None, prefill: PoolView, decode: PoolView,
           now: float) -> Decision:
    views = {"prefill": prefill, "decode": decode}
    lens = {
        "prefill": obs.mean_input_tokens if obs else None,
        "decode": obs.mean_output_tokens if obs else None,
    }
    configured = {"prefill": policy.prefill_capacity, "decode": policy.decode_capacity}

    # 1. Learned capacities (even when this decision holds, the observation is still evidence).
    pool_states = {r: state.pool(r) for r in POOLS}
    if obs is not None:
        pool_states["prefill"] = replace(pool_states["prefill"], learned_capacity=learn_capacity(
            pool_states["prefill"].learned_capacity, obs.prefill_tokens_per_instance, obs.prefill_saturated))
        pool_states["decode"] = replace(pool_states["decode"], learned_capacity=learn_capacity(
            pool_states["decode"].learned_capacity, obs.decode_tokens_per_instance, obs.decode_saturated))

    capacity: dict[str, float | None] = {}
    source: dict[str, str] = {}
    for r in POOLS:
        if configured[r]:
            capacity[r], source[r] = configured[r], "spec"
        elif pool_states[r].learned_capacity:
            capacity[r], source[r] = pool_states[r].learned_capacity, "learned"
        else:
            capacity[r], source[r] = None, "unknown"

    rate = obs.request_rate if obs else None
    metrics_ok = obs is not None and rate is not None and (
        rate == 0 or (lens["prefill"] is not None and lens["decode"] is not None)
    )
    inputs = {
        "requestRate": rate,
        "meanInputTokens": lens["prefill"],
        "meanOutputTokens": lens["decode"],
        "prefillCapacity": capacity["prefill"],
        "decodeCapacity": capacity["decode"],
        "prefillCapacitySource": source["prefill"],
        "decodeCapacitySource": source["decode"],
        "headroom": policy.headroom,
    }

    # 2. Raw recommendations (None = cannot compute: hold this pool).
    need: dict[str, float | None] = {}
    for r in POOLS:
        if not metrics_ok:
            need[r] = None
        elif rate == 0:
            need[r] = 0.0
        elif capacity[r] is None:
            need[r] = None
        else:
            need[r] = policy.headroom * rate * lens[r] / capacity[r]  # type: ignore[operator]

    raw = {r: (replicas_for(need[r]) if need[r] is not None else views[r].current) for r in POOLS}
    clamped_p, clamped_d, limited_by = clamp_pair(raw["prefill"], raw["decode"], policy.bounds)
    rec: dict[str, int | None] = {
        "prefill": clamped_p if need["prefill"] is not None else None,
        "decode": clamped_d if need["decode"] is not None else None,
    }
    limited_by = [x for x in limited_by if not x.startswith("min-")]

    # 3. Stability rules per pool.
    out: dict[str, PoolDecision] = {}
    for r in POOLS:
        view, ps = views[r], pool_states[r]
        current = view.current
        stalled = False
        if not metrics_ok:
            reason = METRICS_UNAVAILABLE
        elif rec[r] is None:
            reason = CAPACITY_UNKNOWN
        else:
            reason = ""
        desired = current
        if not reason and view.ready < current:
            ref = ps.last_change if ps.last_change is not None else view.since
            waited = now - ref if ref is not None else math.inf
            if waited < policy.rollout_timeout_seconds:
                reason = ROLLOUT
            else:
                stalled = True  # decide anyway; surfaced as ScalingLimited
        if not reason:
            target = rec[r]
            assert target is not None
            budget_limited = "max-total-replicas" in limited_by
            load = need[r] or 0.0  # h·λ·len/C: instances needed with headroom, unrounded
            if target > current:
                desired = min(target, current + policy.max_up_step)
                reason = SCALE_UP
                ps = replace(ps, below_since=None, max_need=None, last_change=now)
            else:
                # "Lower" needs a margin (DOWN_TOLERANCE) so that noise around a replica boundary
                # does not count as a lower recommendation.
                with_margin = replicas_for(load * (1 + DOWN_TOLERANCE))
                lower = target < current and (budget_limited or with_margin < current)
                if not lower:
                    reason = STEADY
                    ps = replace(ps, below_since=None, max_need=None)
                else:
                    if ps.below_since is None:
                        ps = replace(ps, below_since=now, max_need=load)
                    else:
                        ps = replace(ps, max_need=max(ps.max_need or 0.0, load))
                    if now - ps.below_since < policy.stabilization_seconds:  # type: ignore[operator]
                        reason = STABILIZING
                    else:
                        lo, _ = policy.bounds.of(r)
                        # the highest load seen in the window, with the margin, must still fit
                        floor_ = target if budget_limited else max(
                            target, replicas_for((ps.max_need or 0.0) * (1 + DOWN_TOLERANCE)))
                        desired = max(floor_, current - policy.max_down_step, lo)
                        if desired < current:
                            reason = SCALE_DOWN
                            ps = replace(ps, last_change=now)
                        else:
                            reason = NO_HEADROOM
                            desired = current
        # Bounds changed in the spec always apply, even while holding.
        desired = policy.bounds.clamp(r, desired)
        pool_states[r] = ps
        out[r] = PoolDecision(current, rec[r], desired, reason, capacity[r], source[r], stalled)

    if any(out[r].rollout_stalled for r in POOLS):
        limited_by = [*limited_by, "rollout-stalled"]
    new_state = State(prefill=pool_states["prefill"], decode=pool_states["decode"])
    return Decision(
        prefill=out["prefill"],
        decode=out["decode"],
        reason=_overall_reason(out["prefill"], out["decode"]),
        limited_by=limited_by,
        inputs=inputs,
        state=new_state,
        metrics_available=metrics_ok,
    )
