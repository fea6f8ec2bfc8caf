"""The autoscaler's pure core: observations + state + policy -> a decision and the next state.

No I/O and no clock: `now` is an argument; the state lives in the PDCluster's status (`status.py`
converts), so a restarted operator forgets neither capacities nor windows. Rules (docs/operator.md):

- Need per pool: `max(h·λ·I'/C_p, λ_peak·I'/C_p·b/(b+TTFT))` prefill, `max(h·λ·w_d, λ_peak·w_d)` decode
  with w_d = O/C_d + t_join (with a configured C_d only: the configured t_join, else the observed decode
  admission seconds per request; `autoscaler_rules.join_seconds`), where I' = I·(1 - prefix hit rate) and
  λ_peak the highest `burstWindowSeconds` (b) rate in the window; clamped to the bounds (`maxTotalReplicas` keeps the
  ratio). Zero traffic -> the minimums. With a TTFT target, prefill needs at least the instances its
  prompt-length tail asks for (`autoscaler_tail`: M/G/c at max(λ, λ_peak·b/(b+TTFT)), applied past an SCV of 1).
- Capacities: the spec's, else learned from saturated windows (EWMA; `autoscaler_rules.learn_capacity`),
  never from warm-up windows (pods starting, or a window that began before the pool's last change);
  either one times the SLO correction. Capacity unknown -> hold the pool.
- SLO guard: a latency percentile over `spec.autoscaling.slo` with a queue in front of the pool that adds
  a real wait, and is still there at the window's end, grows it (by current·(target + wait)/target, at
  least one) even when the formula says enough, and cuts its capacity correction (which
  fades while the SLO is met or the breach has no queue) unless the pool changed within the window (a
  backlog left from before the change says nothing of capacity); once per window after the pool's last
  change, sooner when the queue alone still waits longer than the target once the change is ready and the
  ready pool's spare instances would not work it off within a window.
- Scale up at once (at most `maxScaleUpStep`). Scale down only after the need stayed below the current
  size (with a 10% margin, DOWN_TOLERANCE) for `scaleDownStabilizationSeconds`, to the highest need of
  the sliding window of that length, and not below the need of bursts that broke the SLO within
  `burstMemorySeconds`; at most `maxScaleDownStep` per decision.
- Wait while a change rolls out (ready < desired), but after `rolloutTimeoutSeconds` decide anyway and
  report the stall (ScalingLimited): Pending pods never wedge the autoscaler. A formula need past the pods
  already ordered does not wait (it counts instances from the rate, not from the pool). No metrics -> hold.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pdcluster.operator import autoscaler_guard as slo_guard
from pdcluster.operator import autoscaler_ratio as ratio_bounds
from pdcluster.operator import autoscaler_rules as rules
from pdcluster.operator import autoscaler_tail as tails
from pdcluster.operator.autoscaler_ratio import RATIO_BOUND, RatioBounds
from pdcluster.operator.planner import Bounds, clamp_pair, replicas_for

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
SLO_GUARD = "SLOBreached"  # a pool grown because its latency percentile broke spec.autoscaling.slo
ROLLOUT = "RolloutInProgress"
CAPACITY_UNKNOWN = "CapacityUnknown"
METRICS_UNAVAILABLE = "MetricsUnavailable"
DISABLED = "AutoscalingDisabled"
# a formula scale-up that the trusted short window does not ask for (`decide`'s `short_need`)
UNCONFIRMED = "ScaleUpUnconfirmed"
# RATIO_BOUND ("RatioBound", autoscaler_ratio): a pool moved to keep spec.autoscaling.ratio

_HOLD_PRIORITY = [METRICS_UNAVAILABLE, ROLLOUT, CAPACITY_UNKNOWN, UNCONFIRMED, STABILIZING, NO_HEADROOM, STEADY]


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
    # Optional (None = series missing or not asked for; the rule that uses it is then skipped):
    prefix_hit_rate: float | None = None  # share of prompt tokens served from the prefix cache
    peak_request_rate: float | None = None  # highest short-window (burst) λ within the window
    ttft_seconds: float | None = None  # observed TTFT at the SLO percentile over the window
    tpot_seconds: float | None = None  # observed TPOT at the SLO percentile over the window
    prefill_queue_mean: float | None = None  # requests waiting in the pool, averaged over the window
    decode_queue_mean: float | None = None
    decode_join_seconds: float | None = None  # t_join: mean s from a request's KV complete to its first output
    prefill_queue_now: float | None = None  # requests waiting in the pool at the end of the window
    decode_queue_now: float | None = None
    kv_transfers_per_second: float | None = None  # completed prefill->decode KV transfers (KVTransferDegraded)
    kv_transfer_failures_per_second: float | None = None
    # mean generated tokens of the requests that finished in the window (the router's
    # pdcluster_request_generation_tokens sum / count): O by completion, which does not lag a turn of the mix
    # toward long answers as O by admission does (autoscaler_flip_window)
    finished_output_tokens: float | None = None
    # requests/s the router prefilled on decode workers because the prefill queue missed its TTFT target
    # (pdcluster_router_placements_total{placement="aggregated",reason="prefill_backlog"}): their batches
    # waited meanwhile, so decode's TPOT breach in such a window is the valve's price (autoscaler_guard.valve_explains)
    load_aggregated_rate: float | None = None
    # squared coefficient of variation of the prompt lengths of the requests that finished over the last
    # `autoscaler_tail.SCV_WINDOW_SECONDS` (the router's pdcluster_request_prompt_tokens buckets, `histogram_scv`):
    # the prefill tail need
    prompt_length_scv: float | None = None


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
    decode_join_seconds: float | None = None  # configured t_join (the stream profile's); None: the live series
    # The metrics window: a window that began before the pool's last change is warm-up (None: unknown, so
    # only windows while pods are still starting are; spec-built policies always know it).
    window_seconds: float | None = None
    burst_window_seconds: float | None = None  # the window of the peak λ (spec.autoscaling.burstWindowSeconds)
    burst_memory_seconds: float = 3600.0  # how long the need of a burst (peak λ) holds the pool up
    bursty_ratio: float = 2.0  # a window is bursty when its peak λ is at least this multiple of its mean
    slo_ttft_seconds: float | None = None  # spec.autoscaling.slo: None = no SLO guard for that pool
    slo_tpot_seconds: float | None = None
    slo_percentile: float = 0.99
    use_prefix_hits: bool = True  # discount I by the observed prefix-cache hit rate
    adaptive_headroom: bool = True  # headroom follows the window's variability, `headroom` its ceiling
    ratio: RatioBounds = field(default_factory=RatioBounds)  # spec.autoscaling.ratio (P/D), kept by every decision
    tail_need: bool = True  # prefill also sized for the prompt-length tail (autoscaler_tail), with a TTFT target

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
            window_seconds=float(a.windowSeconds),
            burst_window_seconds=float(a.burstWindowSeconds),
            burst_memory_seconds=float(a.burstMemorySeconds),
            slo_ttft_seconds=a.slo.ttftSeconds,
            slo_tpot_seconds=a.slo.tpotSeconds,
            slo_percentile=a.slo.percentile,
            adaptive_headroom=a.adaptiveHeadroom,
            ratio=RatioBounds(a.ratio.min, a.ratio.max),
        )


@dataclass(frozen=True)
class PoolState:
    below_since: float | None = None  # when recommendations first fell below the current size
    max_need: float | None = None  # highest unrounded need (h·λ·len/C) over the last stabilization period
    last_change: float | None = None  # when the operator last changed this pool's size
    learned_capacity: float | None = None
    recent_needs: tuple[tuple[float, float], ...] = ()  # (time, need) within the stabilization period
    recent_bursts: tuple[tuple[float, float], ...] = ()  # (time, need of the peak λ) within the burst memory
    capacity_scale: float = 1.0  # SLO correction of the capacity (1 = as configured/learned)
    slo_breaches: int = 0  # SLO-guard scale-ups so far (status and the operator metric)
    tensor_parallel: int | None = None  # the pool's TP size all of the above was observed at (for_layout)
    ready_at: float | None = None  # when the last change was first seen ready (its capacity changed then)

    def for_layout(self, tp: int, now: float) -> PoolState:
        """This state if it was observed at TP `tp`, else a fresh one. All of it is in units of instances of
        the pool's layout (capacity of one pod, its SLO correction, pods needed), and a pod at TP 4 is another
        instance than one at TP 1: after a change the pool learns afresh, and the change counts as its last
        change, so the windows of the rollout teach nothing (`rules.warming_up`). The SLO-breach counter
        carries on (a count for the operator's metric, not a belief about capacity). A state recorded before
        TP existed (None) was learned at TP 1."""
        if (self.tensor_parallel or 1) == tp:
            return self if self.tensor_parallel == tp else replace(self, tensor_parallel=tp)
        return PoolState(last_change=now, tensor_parallel=tp, slo_breaches=self.slo_breaches)


@dataclass(frozen=True)
class State:
    prefill: PoolState = field(default_factory=PoolState)
    decode: PoolState = field(default_factory=PoolState)

    def pool(self, role: str) -> PoolState:
        return getattr(self, role)

    def for_layout(self, tp: Mapping[str, int], now: float) -> State:
        """The state valid for the pools' current TP sizes (`tp`: role -> tensorParallelSize)."""
        return State(prefill=self.prefill.for_layout(int(tp["prefill"]), now),
                     decode=self.decode.for_layout(int(tp["decode"]), now))


@dataclass(frozen=True)
class PoolDecision:
    current: int
    recommended: int | None
    desired: int
    reason: str
    capacity: float | None
    capacity_source: str  # spec | learned | unknown
    rollout_stalled: bool = False
    slo_breached: bool = False  # the observed percentile broke this pool's SLO target


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


def _overall_reason(p: PoolDecision, d: PoolDecision) -> str:
    ups = [x for x in (p, d) if x.desired > x.current]
    downs = [x for x in (p, d) if x.desired < x.current]
    if ups and downs:
        return REBALANCE
    if ups:
        return SLO_GUARD if any(x.reason == SLO_GUARD for x in ups) else SCALE_UP
    if downs:
        return SCALE_DOWN
    for reason in _HOLD_PRIORITY:
        if reason in (p.reason, d.reason):
            return reason
    return STEADY


def _learn(policy: Policy, ps: PoolState, view: PoolView, observed: float | None, saturated: bool,
           now: float) -> PoolState:
    if rules.warming_up(now, ps.last_change, view.since, view.current, view.ready, policy.window_seconds):
        return ps  # a cold-start sample: not evidence of capacity
    return replace(ps, learned_capacity=rules.learn_capacity(ps.learned_capacity, observed, saturated))


def _capacity(configured: float | None, ps: PoolState) -> tuple[float | None, str]:
    if configured:
        return configured * ps.capacity_scale, "spec"
    if ps.learned_capacity:
        return ps.learned_capacity * ps.capacity_scale, "learned"
    return None, "unknown"


def _scale_down(policy: Policy, role: str, ps: PoolState, current: int, target: int, load: float,
                budget_limited: bool, now: float) -> tuple[int, str, PoolState]:
    """Hold, or shrink after the stabilization period to the highest need of its window (with margin)."""
    # "Lower" needs a margin (DOWN_TOLERANCE) so that noise around a replica boundary does not count.
    with_margin = replicas_for(load * (1 + DOWN_TOLERANCE))
    if not (target < current and (budget_limited or with_margin < current)):
        return current, STEADY, replace(ps, below_since=None)
    if ps.below_since is None:
        ps = replace(ps, below_since=now)
    if now - ps.below_since < policy.stabilization_seconds:  # type: ignore[operator]
        return current, STABILIZING, ps
    lo, _ = policy.bounds.of(role)
    # the highest load of the window, with the margin, must still fit
    floor_ = target if budget_limited else max(target, replicas_for((ps.max_need or 0.0) * (1 + DOWN_TOLERANCE)))
    desired = max(floor_, current - policy.max_down_step, lo)
    if desired < current:
        return desired, SCALE_DOWN, replace(ps, last_change=now)
    return current, NO_HEADROOM, ps


def _pool_decision(policy: Policy, role: str, ps: PoolState, view: PoolView, rec: int | None, need: float | None,
                   burst_need: float, guard: bool, budget_limited: bool, metrics_ok: bool, now: float,
                   slo: tuple[float | None, float | None] = (None, None),
                   wait: tuple[float | None, float | None] = (None, None),
                   confirm: float | None = None) -> tuple[int, str, bool, PoolState]:
    """(desired, reason, rollout stalled, next state) for one pool: the stability rules. `confirm`: the short
    window's need with headroom (`decide`'s `short_need`), which a formula scale-up must exceed."""
    current, stalled = view.current, False
    if not metrics_ok:
        return current, METRICS_UNAVAILABLE, False, ps
    if rec is None:
        return current, CAPACITY_UNKNOWN, False, ps
    if view.ready < current:
        ref = ps.last_change if ps.last_change is not None else view.since
        waited = now - ref if ref is not None else math.inf
        if waited >= policy.rollout_timeout_seconds:
            stalled = True  # decide anyway; surfaced as ScalingLimited
        elif rec <= current:
            return current, ROLLOUT, False, ps
        else:
            # The formula's need is an absolute count from the rate, so pods still starting are not counted
            # twice: a load that outgrew the last order gets the rest now, not a decision period after the
            # pods ordered for less are ready (a burst onto a pool scaling up from a smaller step: 40 prompts
            # queued for the 30 s of the hold). The guard (a step relative to the pool) and scale-down wait.
            guard = False
    load = need or 0.0  # h·λ·len/C: instances needed with headroom, unrounded
    # The sliding window of needs: scale-down targets the highest need of the last stabilization period.
    seed = ps.recent_needs or (  # a state written before the window existed: its max counts once
        ((ps.below_since, ps.max_need),) if ps.below_since is not None and ps.max_need is not None else ())
    window = rules.NeedWindow(seed).add(now, load, policy.stabilization_seconds)
    bursts = rules.NeedWindow(ps.recent_bursts).add(now, burst_need, policy.burst_memory_seconds)
    ps = replace(ps, recent_needs=window.as_tuple(), recent_bursts=bursts.as_tuple(),
                 max_need=max(window.peak() or 0.0, bursts.peak() or 0.0))
    _, hi = policy.bounds.of(role)
    guard_up = guard and (hi is None or current < hi) and not budget_limited
    target = rec
    if guard_up and target <= current:
        # The SLO is broken although the formula says enough: more replicas now (in proportion to the
        # breach, maxScaleUpStep at most), and the capacity the formula believes in is corrected for the
        # next decisions. (When the formula already asks for more, the load explains the breach.)
        target = current + rules.guard_step(current, *slo, wait=wait[0], wait_now=wait[1])
        cut = rules.capacity_cut(ps.capacity_scale, slo_guard.changed_within_window(policy, ps, view, now))
        ps = replace(ps, capacity_scale=cut, slo_breaches=ps.slo_breaches + 1)
    if target > current:
        reason = SLO_GUARD if guard_up and rec <= current else SCALE_UP
        if reason == SCALE_UP and confirm is not None and replicas_for(confirm) <= current:
            # the window asks for more than the last flipWindowSeconds do with the same headroom (a turn of the
            # mix it still averages in): a pod ordered now, ready a pod start later, would serve a load that left
            return current, UNCONFIRMED, stalled, replace(ps, below_since=None)
        return min(target, current + policy.max_up_step), reason, stalled, replace(ps, below_since=None,
                                                                                     last_change=now)
    desired, reason, ps = _scale_down(policy, role, ps, current, target, load, budget_limited, now)
    return desired, reason, stalled, ps


def decide(policy: Policy, state: State, obs: Observation | None, prefill: PoolView, decode: PoolView,
           now: float, short_need: Mapping[str, float] | None = None) -> Decision:
    """The decision for both pools from the window `obs`. `short_need`: per pool, the need (instances,
    unrounded, no headroom) of a trusted short window (`autoscaler_flip_window.short_needs`, with role flips
    on); with this decision's headroom it must also ask for a formula scale-up, else the pool holds
    (`ScaleUpUnconfirmed`, cause `stabilization`)."""
    views = {"prefill": prefill, "decode": decode}
    hit = obs.prefix_hit_rate if obs is not None and policy.use_prefix_hits else None
    mean_in = obs.mean_input_tokens if obs else None
    lens = {"prefill": rules.prefill_tokens(mean_in, hit) if mean_in is not None else None,
            "decode": obs.mean_output_tokens if obs else None}
    configured = {"prefill": policy.prefill_capacity, "decode": policy.decode_capacity}
    rate = obs.request_rate if obs else None
    metrics_ok = obs is not None and rate is not None and (rate == 0 or None not in lens.values())

    # 1. Learned capacities (even when this decision holds, the observation is still evidence), never
    # from a window that saw the pool warming up; 2. the SLO guard; 3. the capacities the formula uses.
    pool_states = {r: state.pool(r) for r in POOLS}
    guard: dict[str, bool] = {}
    capacity: dict[str, float | None] = {}
    source: dict[str, str] = {}
    for r in POOLS:
        if obs is not None:
            tput = obs.prefill_tokens_per_instance if r == "prefill" else obs.decode_tokens_per_instance
            sat = obs.prefill_saturated if r == "prefill" else obs.decode_saturated
            pool_states[r] = _learn(policy, pool_states[r], views[r], tput, sat, now)
        pool_states[r] = slo_guard.note_ready(pool_states[r], views[r], now)
        guard[r], pool_states[r] = slo_guard.guard(policy, obs, pool_states[r], views[r], r, bool(metrics_ok and rate),
                                                   now)
        capacity[r], source[r] = _capacity(configured[r], pool_states[r])

    peak = obs.peak_request_rate if obs else None
    slo = slo_guard.slo_targets(policy, obs)
    gslo = slo_guard.targets(policy, obs)
    headroom = rules.effective_headroom(policy.headroom, rate, peak, policy.bursty_ratio,
                                        policy.burst_window_seconds) if policy.adaptive_headroom else policy.headroom
    join = rules.join_seconds(obs.decode_join_seconds if obs else None, source["decode"], policy.decode_join_seconds)
    inputs = {
        "requestRate": rate, "peakRequestRate": peak, "meanInputTokens": mean_in, "prefixHitRate": hit,
        "meanOutputTokens": lens["decode"],
        "prefillCapacity": capacity["prefill"], "decodeCapacity": capacity["decode"],
        "prefillCapacitySource": source["prefill"], "decodeCapacitySource": source["decode"],
        "headroom": round(headroom, 4), "headroomCeiling": policy.headroom,
        "ttftSeconds": slo["prefill"][0], "tpotSeconds": slo["decode"][0], "decodeJoinSeconds": join,
        "loadAggregatedRate": obs.load_aggregated_rate if obs else None,  # a TPOT breach it explains grows no decode
        "ratioMin": policy.ratio.min, "ratioMax": policy.ratio.max,
        "maxScaleUpStep": policy.max_up_step, "maxScaleDownStep": policy.max_down_step,
    }

    # 4. Raw needs (None = cannot compute: hold this pool). Bursts recur (the Azure code trace: 10 s
    # bursts minutes apart) and a pod starts long after a burst is over, so the need of a burst that hurt
    # is remembered for `burst_memory_seconds`: a window whose peak is far above its mean, with the SLO
    # broken, or while earlier such bursts are still remembered (bursts absorbed thanks to the memory keep
    # it alive). A peak close to the mean is noise, and the edge of a level shift that the pool absorbed
    # breaks nothing: the ordinary stabilization window holds those.
    need: dict[str, float | None] = {}
    works: dict[str, float] = {}  # one request's instance-seconds per pool, where the need is computed
    burst_need = {r: 0.0 for r in POOLS}
    for r in POOLS:
        if not metrics_ok or (rate and capacity[r] is None):
            need[r] = None
        elif rate == 0:
            need[r] = 0.0
        else:
            work = works[r] = lens[r] / capacity[r] + (join if r == "decode" else 0.0)  # type: ignore[operator]
            spread = rules.burst_spread(r, policy.burst_window_seconds, policy.slo_ttft_seconds)
            need[r], burst = rules.pool_need(rate, peak, work, headroom, spread)  # type: ignore[arg-type]
            if r == "prefill":
                # the rate the pool serves within the target: the mean, or a burst's peak over b + TTFT
                tail = inputs["prefillTailNeed"] = tails.pool_tail(
                    policy, obs, max(rate or 0.0, (peak or 0.0) * spread), work)
                if tail is not None and tail > need[r]:  # type: ignore[operator]
                    need[r] = tail
            inputs[f"{r}BurstNeed"] = burst  # explains a step (autoscaler_explain): burst or formula
            bursty = bool(peak and peak >= policy.bursty_ratio * rate)  # type: ignore[operator]
            if bursty and (rules.breached(*gslo[r]) or any(n > 0 for _, n in pool_states[r].recent_bursts)):
                burst_need[r] = burst

    confirm: dict[str, float | None] = {r: None for r in POOLS}
    for r in POOLS:
        inputs[f"{r}Need"] = need[r]  # unrounded instances, headroom included
        if short_need is not None and (sn := short_need.get(r)) is not None and math.isfinite(sn):
            confirm[r] = inputs[f"{r}ShortNeed"] = headroom * sn
            if r == "prefill" and (w := works.get(r)):  # the tail need at the rate the short window asks for
                short_tail = tails.pool_tail(policy, obs, headroom * sn / w, w)
                confirm[r] = max(headroom * sn, short_tail or 0.0)
    raw = {r: (replicas_for(n) if (n := need[r]) is not None else views[r].current) for r in POOLS}
    clamped_p, clamped_d, limited_by = clamp_pair(raw["prefill"], raw["decode"], policy.bounds)
    rec: dict[str, int | None] = {
        "prefill": clamped_p if need["prefill"] is not None else None,
        "decode": clamped_d if need["decode"] is not None else None,
    }
    limited_by = [x for x in limited_by if not x.startswith("min-")]
    budget_limited = "max-total-replicas" in limited_by

    # 5. Stability rules per pool; bounds changed in the spec always apply, even while holding.
    out: dict[str, PoolDecision] = {}
    for r in POOLS:
        desired, reason, stalled, pool_states[r] = _pool_decision(
            policy, r, pool_states[r], views[r], rec[r], need[r], burst_need[r], guard[r], budget_limited,
            metrics_ok, now, gslo[r], slo_guard.wait(obs, r), confirm[r])
        out[r] = PoolDecision(views[r].current, rec[r], policy.bounds.clamp(r, desired), reason, capacity[r],
                              source[r], stalled, slo_breached=rules.breached(*slo[r]))

    if any(out[r].rollout_stalled for r in POOLS):
        limited_by = [*limited_by, "rollout-stalled"]
    ratio_moved, ratio_limits = ratio_bounds.keep(policy, out, pool_states, now)
    limited_by = [*limited_by, *ratio_limits]
    return Decision(
        prefill=out["prefill"],
        decode=out["decode"],
        reason=RATIO_BOUND if ratio_moved else _overall_reason(out["prefill"], out["decode"]),
        limited_by=limited_by,
        inputs=inputs,
        state=State(prefill=pool_states["prefill"], decode=pool_states["decode"]),
        metrics_available=metrics_ok,
    )
