"""The scaling step of a reconcile pass: how many prefill and decode replicas a PDCluster should run now.

The operator is the single writer of the worker Deployments' replicas. With autoscaling off they come from
the spec. With it on, the autoscaler core (`autoscaler.decide`) is asked every `intervalSeconds`, from
its state kept in `status.autoscaler`; between evaluations the last desired counts hold. Either way the
pool bounds of the spec apply last (`planner.clamp_replicas`, the one clamp).

Everything here is pure except `observe` (asks Prometheus, off the event loop) and `record_metrics`
(the operator's own Prometheus gauges); the reconciler emits the Events this step asks for.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from pdcluster.operator import autoscaler as asc
from pdcluster.operator import (
    autoscaler_explain,
    autoscaler_flip,
    autoscaler_flip_window,
    flips,
    naming,
    opmetrics,
    transfer_health,
)
from pdcluster.operator import status as st
from pdcluster.operator.models import PDClusterSpec
from pdcluster.operator.promsource import MetricsUnavailable

ROLES = naming.WORKER_ROLES
# condition type -> (the status that deserves a Warning Event, the Event's reason)
WARN_WHEN = {"MetricsAvailable": ("False", "MetricsUnavailable"), "ScalingLimited": ("True", "ScalingLimited"),
             "SLOMet": ("False", "SLOBreached"), "KVTransferDegraded": ("True", "KVTransferDegraded")}


class MetricsSource(Protocol):
    def observe(self, cluster: str, window_seconds: int, ready: dict[str, int] | None = None, *,
                percentile: float | None = None, burst_seconds: int = 0,
                engine: str = "pdcluster") -> asc.Observation: ...


@dataclass(frozen=True)
class Pools:
    """The worker pools as the cluster shows them now."""

    current: dict[str, int | None]  # Deployment spec.replicas; None while the Deployment does not exist
    ready: dict[str, int]
    created: dict[str, float | None]  # Deployment creation time (epoch seconds), None if unknown/absent


@dataclass(frozen=True)
class Observed:
    """One metrics query's outcome: the observation (None = unavailable) and why, for MetricsAvailable."""

    obs: asc.Observation | None
    reason: str
    message: str


@dataclass(frozen=True)
class Step:
    desired: dict[str, int]
    next_delay: float
    conditions: list[dict[str, Any]] = field(default_factory=list)  # MetricsAvailable, ScalingLimited
    autoscaler_status: dict[str, Any] = field(default_factory=dict)  # {} = no status.autoscaler
    decision: asc.Decision | None = None  # set when the autoscaler was evaluated in this pass
    scaled_message: str | None = None  # a Normal/Scaled Event to emit: the decision changed replicas
    before_flips: dict[str, int] | None = None  # the decision's sizes before role flips were planned in (flips.py)


def clamp_all(spec: PDClusterSpec, replicas: Mapping[str, int]) -> dict[str, int]:
    bounds = asc.Policy.from_spec(spec).bounds
    return {r: bounds.clamp(r, replicas[r]) for r in ROLES}


def base_replicas(spec: PDClusterSpec, old_status: Mapping[str, Any], current: Mapping[str, int | None]
                  ) -> dict[str, int]:
    """Where the autoscaler starts from: the last desired count it recorded, else what runs, else the spec."""
    pools = {"prefill": spec.prefill, "decode": spec.decode}
    base = {}
    for r in ROLES:
        prev = (old_status.get(r) or {}).get("desiredReplicas")
        start = prev if isinstance(prev, int) and prev > 0 else (current[r] or pools[r].initial_replicas)
        base[r] = start
    return clamp_all(spec, base)


def last_evaluation(autoscaler_status: Mapping[str, Any]) -> float | None:
    try:
        return st.parse_time(autoscaler_status["lastEvaluationTime"]) \
            if autoscaler_status.get("lastEvaluationTime") else None
    except ValueError:
        return None


def is_due(last_eval: float | None, interval_seconds: float, now: float) -> bool:
    # Half a second of slack: a resync scheduled for exactly the interval must not miss it by jitter.
    return last_eval is None or now - last_eval >= interval_seconds - 0.5


def disabled(spec: PDClusterSpec, resync_seconds: float) -> Step:
    return Step(
        desired=clamp_all(spec, {"prefill": spec.prefill.initial_replicas, "decode": spec.decode.initial_replicas}),
        next_delay=resync_seconds,
        conditions=[
            st.condition("MetricsAvailable", "Unknown", "AutoscalingDisabled", "autoscaling is disabled"),
            st.condition("ScalingLimited", False, "AutoscalingDisabled", "replicas come from the spec"),
            st.condition("SLOMet", "Unknown", "AutoscalingDisabled", "autoscaling is disabled"),
            st.condition(transfer_health.CONDITION, "Unknown", "AutoscalingDisabled",
                         "read from the autoscaler's Prometheus: autoscaling is disabled"),
        ],
    )


def hold(base: dict[str, int], autoscaler_status: Mapping[str, Any], last_eval: float, interval_seconds: float,
         now: float, resync_seconds: float) -> Step:
    """Not due yet: keep the last desired counts and wake up when the interval is over."""
    return Step(desired=dict(base), autoscaler_status=dict(autoscaler_status),
                next_delay=min(resync_seconds, max(1.0, interval_seconds - (now - last_eval))))


def metrics_condition(observed: Observed, decision: asc.Decision) -> dict[str, Any]:
    if observed.obs is None:
        return st.condition("MetricsAvailable", False, observed.reason, observed.message)
    if not decision.metrics_available:
        return st.condition("MetricsAvailable", False, "SeriesMissing",
                            "token series missing while requests are flowing")
    return st.condition("MetricsAvailable", True, observed.reason, observed.message)


def scaling_condition(decision: asc.Decision) -> dict[str, Any]:
    limits = decision.limited_by
    if not limits:
        return st.condition("ScalingLimited", False, "WithinBounds", "the recommendation fits the bounds")
    reason = ("RolloutStalled" if "rollout-stalled" in limits else
              "RatioUnsatisfiable" if "ratio-unsatisfiable" in limits else
              "TotalReplicaBudget" if "max-total-replicas" in limits else
              "RatioBound" if any(x.startswith("ratio-") for x in limits) else "AtMaxReplicas")
    return st.condition("ScalingLimited", True, reason, "limited by: " + ", ".join(limits))


def slo_condition(spec: PDClusterSpec, decision: asc.Decision) -> dict[str, Any]:
    """SLOMet: False while an observed latency percentile breaks spec.autoscaling.slo."""
    slo = spec.autoscaling.slo
    if slo.ttftSeconds is None and slo.tpotSeconds is None:
        return st.condition("SLOMet", "Unknown", "NoSLO", "spec.autoscaling.slo sets no target")
    q = f"p{100 * slo.percentile:g}"
    ttft, tpot = decision.inputs.get("ttftSeconds"), decision.inputs.get("tpotSeconds")
    broken = []
    if decision.prefill.slo_breached:
        broken.append(f"TTFT {q} {_fmt(ttft, ' s')} > {slo.ttftSeconds:g} s (prefill grows)")
    if decision.decode.slo_breached:
        broken.append(f"TPOT {q} {_fmt(tpot, ' s')} > {slo.tpotSeconds:g} s (decode grows)")
    if broken:
        return st.condition("SLOMet", False, "SLOBreached", "; ".join(broken))
    if (slo.ttftSeconds is not None and ttft is None) and (slo.tpotSeconds is not None and tpot is None):
        return st.condition("SLOMet", "Unknown", "NoLatencySeries", "no latency histogram in the window")
    return st.condition("SLOMet", True, "WithinSLO",
                        f"TTFT {q} {_fmt(ttft, ' s')}, TPOT {q} {_fmt(tpot, ' s')} within the targets")


def _fmt(x: float | None, unit: str = "") -> str:
    return "n/a" if x is None else f"{x:.4g}{unit}"


def scaled_message(decision: asc.Decision, base: Mapping[str, int], desired: Mapping[str, int]) -> str:
    i, c = decision.inputs, autoscaler_explain.causes(decision)
    return (f"prefill {base['prefill']}->{desired['prefill']} ({c['prefill']}), "
            f"decode {base['decode']}->{desired['decode']} ({c['decode']}) "
            f"({decision.reason}: rate {_fmt(i['requestRate'], ' req/s')}, "
            f"I {_fmt(i['meanInputTokens'])}, O {_fmt(i['meanOutputTokens'])}, "
            f"C_p {_fmt(i['prefillCapacity'])} ({i['prefillCapacitySource']}), "
            f"C_d {_fmt(i['decodeCapacity'])} ({i['decodeCapacitySource']}), "
            f"headroom {i['headroom']})")


def _inputs(spec: PDClusterSpec, base: dict[str, int], pools: Pools, autoscaler_status: Mapping[str, Any],
            now: float) -> tuple[asc.State, dict[str, asc.PoolView], asc.Policy]:
    """What a decision and the flip step start from: the state in status, the pools, the spec's policy."""
    # what was learned under another tensor-parallel layout is dropped (State.for_layout)
    state = st.autoscaler_state(autoscaler_status).for_layout(
        {r: spec.pool(r).tensorParallelSize for r in ROLES}, now)
    # A pool with no recorded change waits for its Deployment's first rollout, counted from the
    # Deployment's creation (now, if it is being created in this pass).
    views = {r: asc.PoolView(base[r], pools.ready[r], pools.created[r] or now) for r in ROLES}
    return state, views, asc.Policy.from_spec(spec)


def evaluate(spec: PDClusterSpec, base: dict[str, int], pools: Pools, autoscaler_status: Mapping[str, Any],
             observed: Observed, now: float, short: asc.Observation | None = None) -> Step:
    """One autoscaler evaluation: state from status, decide, and the status/conditions that record it.
    `short`: the flip window's observation (spec.autoscaling.flipWindowSeconds): its need must confirm a formula
    scale-up (`decide`'s `short_need`), and no flip of the decision takes a pool below what that window asks it to keep
    (`autoscaler_flip.plan`)."""
    state, views, policy = _inputs(spec, base, pools, autoscaler_status, now)
    can_flip = flips.incompatible(spec) is None
    window = float(spec.autoscaling.flipWindowSeconds)
    short_need = autoscaler_flip_window.need(policy, state, short, window) if can_flip else None
    decision = asc.decide(policy, state, observed.obs, views["prefill"], views["decode"], now, short_need)
    before_flips = None
    if can_flip:  # spec.roleFlips: the short pool's growth from the other's slack
        before_flips = {r: decision.pool(r).desired for r in ROLES}
        keep = autoscaler_flip_window.keep(policy, decision.state, short, window)
        decision = autoscaler_flip.applied(decision, policy, keep)
    desired = {r: decision.pool(r).desired for r in ROLES}  # within the bounds: decide clamps last
    return Step(
        desired=desired,
        next_delay=float(spec.autoscaling.intervalSeconds),
        conditions=[metrics_condition(observed, decision), scaling_condition(decision),
                    slo_condition(spec, decision), transfer_health.condition(observed.obs)],
        autoscaler_status=st.autoscaler_status(decision, st.fmt_time(now)),
        decision=decision,
        scaled_message=scaled_message(decision, base, desired) if decision.changed else None,
        before_flips=before_flips,
    )


def flip_window_on(spec: PDClusterSpec) -> bool:
    """The short-window flip step runs: spec.autoscaling.flipWindowSeconds set and the pools can flip."""
    return bool(spec.autoscaling.flipWindowSeconds) and flips.incompatible(spec) is None


def flip_window(spec: PDClusterSpec, base: dict[str, int], pools: Pools, autoscaler_status: Mapping[str, Any],
                observed: Observed, now: float) -> Step | None:
    """Between two decisions: flips on the short window `observed` (`autoscaler_flip_window`), or None to hold.
    The step keeps `lastEvaluationTime` (decide's interval runs on), records its decision as the last one and
    the pools' changes in the state; the sizes before its flips are the pools as they are (no pod started)."""
    rec = autoscaler_flip_window.last_recommended(autoscaler_status)
    if observed.obs is None or not rec:
        return None
    state, views, policy = _inputs(spec, base, pools, autoscaler_status, now)
    d = autoscaler_flip_window.window_flips(policy, state, observed.obs, views["prefill"], views["decode"], now,
                                            window_seconds=float(spec.autoscaling.flipWindowSeconds),
                                            recommended=rec)
    if d is None:
        return None
    t = st.fmt_time(now)
    status = {**autoscaler_status, **st.autoscaler_state_status(d.state), "reason": d.reason,
              "lastDecision": st.decision_record(d, t)}
    desired = {r: d.pool(r).desired for r in ROLES}
    return Step(desired=desired, next_delay=autoscaler_flip_window.period(spec.autoscaling.flipWindowSeconds),
                autoscaler_status=status, decision=d, before_flips=dict(base),
                scaled_message=f"{autoscaler_explain.message(d)} ({autoscaler_explain.window_inputs(d)})")


async def observe(source_for: Callable[[str], MetricsSource], cluster: str, spec: PDClusterSpec,
                  ready: dict[str, int], window_seconds: int | None = None) -> Observed:
    """Ask the metrics source (blocking HTTP, so in a thread); never raises. `window_seconds`: the short
    window of the flip step (no percentiles, no peak), else the decisions' own."""
    url = spec.autoscaling.prometheusUrl or ""
    try:
        source = source_for(url)
        auto = spec.autoscaling
        slo_on = auto.slo.ttftSeconds is not None or auto.slo.tpotSeconds is not None
        # the workers' series by engine (promsource.SERIES); pdcluster's call stays as it was
        observe = source.observe if spec.engine == "pdcluster" else functools.partial(source.observe,
                                                                                      engine=spec.engine)
        if window_seconds is not None:
            obs = await asyncio.to_thread(observe, cluster, window_seconds, ready)
        else:
            obs = await asyncio.to_thread(observe, cluster, auto.windowSeconds, ready,
                                          percentile=auto.slo.percentile if slo_on else None,
                                          burst_seconds=auto.burstWindowSeconds)
        return Observed(obs, "QueriesSucceeded", f"Prometheus at {url} answered for pdcluster={cluster}")
    except MetricsUnavailable as e:
        opmetrics.ERRORS.labels("metrics").inc()
        return Observed(None, e.reason, e.message)
    except Exception as e:  # a broken source must never break reconciling the workload
        opmetrics.ERRORS.labels("metrics").inc()
        return Observed(None, "PrometheusUnreachable", f"{type(e).__name__}: {e}")


async def step(spec: PDClusterSpec, old_status: Mapping[str, Any], pools: Pools, now: float, *,
               cluster: str, source_for: Callable[[str], MetricsSource], resync_seconds: float) -> Step:
    """The scaling step: spec replicas, a held count, or a fresh autoscaler evaluation."""
    auto = spec.autoscaling
    if not auto.enabled:
        return disabled(spec, resync_seconds)
    autoscaler_status = dict(old_status.get("autoscaler") or {})
    base = base_replicas(spec, old_status, pools.current)
    last_eval = last_evaluation(autoscaler_status)
    if not is_due(last_eval, auto.intervalSeconds, now):
        assert last_eval is not None
        held = hold(base, autoscaler_status, last_eval, auto.intervalSeconds, now, resync_seconds)
        if not flip_window_on(spec):
            return held
        # between decisions, the short-window flip step (its own period: the hold wakes up for it)
        between = await observe(source_for, cluster, spec, pools.ready, window_seconds=auto.flipWindowSeconds)
        fw = flip_window(spec, base, pools, autoscaler_status, between, now)
        delay = min(held.next_delay, autoscaler_flip_window.period(auto.flipWindowSeconds))
        if fw is None:
            return replace(held, next_delay=delay)
        return replace(fw, next_delay=delay)
    observed = await observe(source_for, cluster, spec, pools.ready)
    short: Observed | None = None
    if flip_window_on(spec):
        short = await observe(source_for, cluster, spec, pools.ready, window_seconds=auto.flipWindowSeconds)
    out = evaluate(spec, base, pools, autoscaler_status, observed, now, short.obs if short else None)
    delay = min(resync_seconds, out.next_delay)
    if short is not None:  # the flip step's period runs on between decisions
        delay = min(delay, autoscaler_flip_window.period(auto.flipWindowSeconds))
    if short is not None and out.decision is not None and not out.decision.changed:
        # a decision that changes nothing: the flip step on the same tick, as between decisions
        fw = flip_window(spec, base, pools, out.autoscaler_status, short, now)
        if fw is not None:
            status = {**fw.autoscaler_status, "lastEvaluationTime": out.autoscaler_status["lastEvaluationTime"]}
            return Step(fw.desired, delay, out.conditions, status, fw.decision, fw.scaled_message, fw.before_flips)
    return Step(out.desired, delay, out.conditions, out.autoscaler_status,
                out.decision, out.scaled_message, out.before_flips)


def record_metrics(owner: naming.Owner, spec: PDClusterSpec, s: Step) -> None:
    """The operator's own gauges/counters for this step (pdcluster_operator_* in opmetrics)."""
    if s.decision is not None:
        opmetrics.DECISIONS.labels(owner.namespace, owner.name, s.decision.reason).inc()
        for r in ROLES:
            ps = s.decision.state.pool(r)
            if ps.learned_capacity:
                opmetrics.LEARNED_CAPACITY.labels(owner.namespace, owner.name, r).set(ps.learned_capacity)
            opmetrics.CAPACITY_SCALE.labels(owner.namespace, owner.name, r).set(ps.capacity_scale)
            if s.decision.pool(r).reason == asc.SLO_GUARD:
                opmetrics.SLO_SCALE_UPS.labels(owner.namespace, owner.name, r).inc()
        for r, cause in autoscaler_explain.causes(s.decision).items():
            if s.decision.pool(r).desired != s.decision.pool(r).current:
                opmetrics.SCALING_STEPS.labels(owner.namespace, owner.name, r, cause).inc()
    for r in ROLES:
        opmetrics.DESIRED.labels(owner.namespace, owner.name, r).set(s.desired[r])
    opmetrics.DESIRED.labels(owner.namespace, owner.name, "router").set(spec.router.replicas)
