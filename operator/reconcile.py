"""One reconcile pass for one PDCluster: validate, decide replicas, drain, apply children, write status.

Level-triggered and idempotent: it reads everything it needs each time (the PDCluster, its Secret and
Deployments, Prometheus when the autoscaler is due) and re-applies every child with server-side apply.
The kopf handlers in `handlers` only decide *when* to call it and map errors to kopf's retry.

Error policy:
- a spec the schema accepted but the operator cannot use -> `Degraded=True` (reason InvalidSpec) and a
  Warning Event once per distinct message; the pass returns normally (no crash loop, no hot retry);
- an API error the server will not fix by itself (4xx other than 409/429) -> `Degraded=True` (reason
  ApplyFailed), Warning Event, returns normally; the periodic resync tries again;
- retryable API errors (5xx, 429, 409, connection errors) propagate as `ApiError`, which the handlers
  turn into `kopf.TemporaryError` (backoff and retry);
- a PDCluster being deleted (`metadata.deletionTimestamp`) is not reconciled at all: no children applied,
  no pods drained, no status written. Its children go with it through their owner references;
- a 403 because the namespace is being terminated (children are refused while the namespace controller
  deletes everything, the PDCluster included) ends the pass quietly: no Degraded, no Event, no retry.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from pdcluster.operator import autoscaler as asc
from pdcluster.operator import drain, naming, opmetrics, render
from pdcluster.operator import status as st
from pdcluster.operator.kube import PDC_API_VERSION, ApiError, Kube
from pdcluster.operator.models import KIND, PDClusterSpec, parse_spec, short_error
from pdcluster.operator.promsource import MetricsUnavailable, PrometheusSource
from pydantic import ValidationError

log = logging.getLogger(__name__)

RESYNC_SECONDS = 60.0


class MetricsSource(Protocol):
    def observe(self, cluster: str, window_seconds: int, ready: dict[str, int] | None = None
                ) -> asc.Observation: ...


EmitFn = Callable[[dict[str, Any], str, str, str], None]

_sources: dict[str, PrometheusSource] = {}


def default_source(url: str) -> MetricsSource:
    if url not in _sources:
        _sources[url] = PrometheusSource(url)
    return _sources[url]


def _log_emit(body: dict[str, Any], type_: str, reason: str, message: str) -> None:
    log.info("event %s %s on %s: %s", type_, reason, body.get("metadata", {}).get("name"), message)


@dataclass
class Context:
    kube: Kube
    emit: EmitFn = _log_emit
    now: Callable[[], float] = time.time
    source_for: Callable[[str], MetricsSource] = default_source
    http: httpx.AsyncClient | None = None
    resync_seconds: float = RESYNC_SECONDS


@dataclass
class Outcome:
    next_delay: float
    status: dict[str, Any] = field(default_factory=dict)
    decision: asc.Decision | None = None
    degraded: str | None = None
    skipped: str | None = None  # why nothing was done: "deleting", "namespace-terminating"


def is_deleting(body: dict[str, Any]) -> bool:
    """The object has been marked for deletion (it may linger while finalizers run)."""
    return bool((body.get("metadata") or {}).get("deletionTimestamp"))


def _strip_none(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_strip_none(v) for v in obj]
    return obj


async def _patch_status(ctx: Context, body: dict[str, Any], new_status: dict[str, Any]) -> None:
    old = body.get("status") or {}
    if _strip_none({k: old.get(k) for k in new_status}) == _strip_none(new_status):
        return
    meta = body["metadata"]
    await ctx.kube.merge_patch(PDC_API_VERSION, KIND, meta.get("namespace"), meta["name"],
                               {"status": new_status}, subresource="status")


def _emit_on_change(ctx: Context, body: dict[str, Any], cond_type: str, bad_status: str, new: dict[str, Any],
                    event_type: str, reason: str) -> None:
    """Emit an Event when a condition turns bad or its message changes (not on every resync)."""
    old = st.get_condition((body.get("status") or {}).get("conditions"), cond_type)
    if new["status"] != bad_status:
        return
    if old and old.get("status") == bad_status and old.get("message") == new["message"]:
        return
    ctx.emit(body, event_type, reason, new["message"])


async def _degraded(ctx: Context, body: dict[str, Any], reason: str, message: str, kind: str) -> Outcome:
    opmetrics.ERRORS.labels(kind).inc()
    meta = body["metadata"]
    old_status = body.get("status") or {}
    now = st.fmt_time(ctx.now())
    deg = st.condition("Degraded", True, reason, message)
    _emit_on_change(ctx, body, "Degraded", "True", deg, "Warning", reason)
    conditions = st.merge_conditions(
        old_status.get("conditions"),
        [deg, st.condition("Ready", False, reason, "the spec cannot be reconciled; see Degraded")],
        now, meta.get("generation"),
    )
    new_status = {"observedGeneration": meta.get("generation"), "conditions": conditions}
    await _patch_status(ctx, body, new_status)
    opmetrics.set_conditions(meta.get("namespace") or "default", meta["name"], conditions)
    return Outcome(ctx.resync_seconds, new_status, degraded=message)


async def _kv_secret_key(ctx: Context, owner: naming.Owner) -> bytes:
    name = naming.secret_name(owner)
    existing = await ctx.kube.get("v1", "Secret", owner.namespace, name)
    if existing is not None:
        raw = (existing.get("data") or {}).get(render.KV_SECRET_KEY)
        if raw:
            return base64.b64decode(raw)
        key = render.new_kv_secret_key()
        await ctx.kube.apply(render.render_secret(owner, key))
        return key
    key = render.new_kv_secret_key()
    try:
        await ctx.kube.create(render.render_secret(owner, key))
    except ApiError as e:
        if e.status != 409:
            raise
        # Created concurrently: re-read and keep theirs.
        existing = await ctx.kube.get("v1", "Secret", owner.namespace, name)
        raw = ((existing or {}).get("data") or {}).get(render.KV_SECRET_KEY)
        if not raw:
            raise ApiError(409, "Conflict", f"secret {name} exists without key") from e
        return base64.b64decode(raw)
    return key


def _creation_time(obj: dict[str, Any] | None) -> float | None:
    ts = ((obj or {}).get("metadata") or {}).get("creationTimestamp")
    try:
        return st.parse_time(ts) if ts else None
    except ValueError:
        return None


def _clamp(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, v))


async def _observe(ctx: Context, owner: naming.Owner, spec: PDClusterSpec, ready: dict[str, int]
                   ) -> tuple[asc.Observation | None, str, str]:
    url = spec.autoscaling.prometheusUrl or ""
    try:
        source = ctx.source_for(url)
        obs = await asyncio.to_thread(source.observe, owner.name, spec.autoscaling.windowSeconds, ready)
        return obs, "QueriesSucceeded", f"Prometheus at {url} answered for pdcluster={owner.name}"
    except MetricsUnavailable as e:
        opmetrics.ERRORS.labels("metrics").inc()
        return None, e.reason, e.message
    except Exception as e:  # a broken source must never break reconciling the workload
        opmetrics.ERRORS.labels("metrics").inc()
        return None, "PrometheusUnreachable", f"{type(e).__name__}: {e}"


def _decision_record(d: asc.Decision, now: str) -> dict[str, Any]:
    def pool(p: asc.PoolDecision) -> dict[str, Any]:
        return {"current": p.current, "recommended": p.recommended, "desired": p.desired, "reason": p.reason,
                "capacitySource": p.capacity_source}

    return {"time": now, "reason": d.reason, "prefill": pool(d.prefill), "decode": pool(d.decode),
            "limitedBy": list(d.limited_by), "inputs": dict(d.inputs)}


def _fmt(x: float | None, unit: str = "") -> str:
    return "n/a" if x is None else f"{x:.4g}{unit}"


async def reconcile(ctx: Context, body: dict[str, Any], trigger: str = "resync") -> Outcome:
    meta = body.get("metadata") or {}
    if is_deleting(body):
        # Never apply children or drain pods of an object on its way out (a foreground deletion, a namespace
        # being deleted, someone else's finalizer): re-creating children here would fight the garbage
        # collector, and in a terminating namespace every create is refused anyway.
        log.debug("%s/%s is being deleted: not reconciling", meta.get("namespace"), meta.get("name"))
        opmetrics.RECONCILES.labels(trigger, "skipped").inc()
        if meta.get("name"):
            opmetrics.forget_conditions(meta.get("namespace") or "default", meta["name"])
        return Outcome(ctx.resync_seconds, skipped="deleting")
    try:
        out = await _reconcile(ctx, body)
        opmetrics.RECONCILES.labels(trigger, "degraded" if out.degraded else "ok").inc()
        return out
    except ApiError as e:
        if e.namespace_terminating:
            log.info("%s/%s: namespace %s is being terminated; nothing to reconcile", meta.get("namespace"),
                     meta.get("name"), meta.get("namespace"))
            opmetrics.RECONCILES.labels(trigger, "skipped").inc()
            return Outcome(ctx.resync_seconds, skipped="namespace-terminating")
        opmetrics.RECONCILES.labels(trigger, "retry").inc()
        opmetrics.ERRORS.labels("api").inc()
        raise


async def _reconcile(ctx: Context, body: dict[str, Any]) -> Outcome:
    body = copy.deepcopy(dict(body))
    owner = naming.Owner.from_body(body)
    meta = body["metadata"]
    old_status = body.get("status") or {}
    generation = meta.get("generation")
    now = ctx.now()
    now_s = st.fmt_time(now)

    # 1. Validate what the schema cannot.
    try:
        spec = parse_spec(body.get("spec"))
        render.model_source(spec.model.uri)
    except ValidationError as e:
        return await _degraded(ctx, body, "InvalidSpec", short_error(e), "invalid_spec")
    except render.RenderError as e:
        return await _degraded(ctx, body, "InvalidSpec", str(e), "invalid_spec")

    # 2. The KV-transfer secret: generated once, then kept.
    key = await _kv_secret_key(ctx, owner)
    fingerprint = render.secret_fingerprint(key)

    # 3. What runs now.
    deps = {r: await ctx.kube.get("apps/v1", "Deployment", owner.namespace, naming.child_name(owner, r))
            for r in render.ROLES}
    current = {r: (st.deployment_replicas(deps[r])[0] if deps[r] else None) for r in render.WORKER_ROLES}
    ready = {r: st.deployment_replicas(deps[r])[2] for r in render.WORKER_ROLES}
    pools = {"prefill": spec.prefill, "decode": spec.decode}

    # 4. Desired replicas (the operator is their single writer).
    auto = spec.autoscaling
    autoscaler_status: dict[str, Any] = dict(old_status.get("autoscaler") or {})
    extra_conditions: list[dict[str, Any]] = []
    decision: asc.Decision | None = None
    if not auto.enabled:
        desired = {r: pools[r].initial_replicas for r in render.WORKER_ROLES}
        extra_conditions += [
            st.condition("MetricsAvailable", "Unknown", "AutoscalingDisabled", "autoscaling is disabled"),
            st.condition("ScalingLimited", False, "AutoscalingDisabled", "replicas come from the spec"),
        ]
        autoscaler_status = {}
        next_delay = ctx.resync_seconds
    else:
        base = {}
        for r in render.WORKER_ROLES:
            prev = (old_status.get(r) or {}).get("desiredReplicas")
            start = prev if isinstance(prev, int) and prev > 0 else (current[r] or pools[r].initial_replicas)
            base[r] = _clamp(start, pools[r].minReplicas, pools[r].maxReplicas)
        last_eval_s = autoscaler_status.get("lastEvaluationTime")
        try:
            last_eval = st.parse_time(last_eval_s) if last_eval_s else None
        except ValueError:
            last_eval = None
        due = last_eval is None or now - last_eval >= auto.intervalSeconds - 0.5
        desired = dict(base)
        if due:
            obs, m_reason, m_message = await _observe(ctx, owner, spec, ready)
            state = asc.state_from_status(autoscaler_status, st.parse_time)
            # A pool with no recorded change waits for its Deployment's first rollout, counted from the
            # Deployment's creation (now, if it is being created in this pass).
            views = {r: asc.PoolView(base[r], ready[r], _creation_time(deps[r]) or now)
                     for r in render.WORKER_ROLES}
            decision = asc.decide(asc.Policy.from_spec(spec), state, obs, views["prefill"], views["decode"], now)
            desired = {r: decision.pool(r).desired for r in render.WORKER_ROLES}
            if obs is None:
                metrics_cond = st.condition("MetricsAvailable", False, m_reason, m_message)
            elif not decision.metrics_available:
                metrics_cond = st.condition("MetricsAvailable", False, "SeriesMissing",
                                            "token series missing while requests are flowing")
            else:
                metrics_cond = st.condition("MetricsAvailable", True, m_reason, m_message)
            _emit_on_change(ctx, body, "MetricsAvailable", "False", metrics_cond, "Warning", "MetricsUnavailable")
            limits = decision.limited_by
            if limits:
                reason = ("RolloutStalled" if "rollout-stalled" in limits else
                          "TotalReplicaBudget" if "max-total-replicas" in limits else "AtMaxReplicas")
                scaling_cond = st.condition("ScalingLimited", True, reason, "limited by: " + ", ".join(limits))
            else:
                scaling_cond = st.condition("ScalingLimited", False, "WithinBounds",
                                            "the recommendation fits the bounds")
            _emit_on_change(ctx, body, "ScalingLimited", "True", scaling_cond, "Warning", "ScalingLimited")
            extra_conditions += [metrics_cond, scaling_cond]
            autoscaler_status = {
                **asc.state_to_status(decision.state, st.fmt_time),
                "lastEvaluationTime": now_s,
                "reason": decision.reason,
                "lastDecision": _decision_record(decision, now_s),
            }
            opmetrics.DECISIONS.labels(owner.namespace, owner.name, decision.reason).inc()
            for r in render.WORKER_ROLES:
                cap = decision.state.pool(r).learned_capacity
                if cap:
                    opmetrics.LEARNED_CAPACITY.labels(owner.namespace, owner.name, r).set(cap)
            if decision.changed:
                i = decision.inputs
                ctx.emit(body, "Normal", "Scaled",
                         f"prefill {base['prefill']}->{desired['prefill']}, decode {base['decode']}->"
                         f"{desired['decode']} ({decision.reason}: rate {_fmt(i['requestRate'], ' req/s')}, "
                         f"I {_fmt(i['meanInputTokens'])}, O {_fmt(i['meanOutputTokens'])}, "
                         f"C_p {_fmt(i['prefillCapacity'])} ({i['prefillCapacitySource']}), "
                         f"C_d {_fmt(i['decodeCapacity'])} ({i['decodeCapacitySource']}), "
                         f"headroom {i['headroom']})")
            next_delay = min(ctx.resync_seconds, float(auto.intervalSeconds))
        else:
            assert last_eval is not None
            next_delay = min(ctx.resync_seconds, max(1.0, auto.intervalSeconds - (now - last_eval)))
    for r in render.WORKER_ROLES:
        desired[r] = _clamp(desired[r], pools[r].minReplicas, pools[r].maxReplicas)
        opmetrics.DESIRED.labels(owner.namespace, owner.name, r).set(desired[r])
    opmetrics.DESIRED.labels(owner.namespace, owner.name, "router").set(spec.router.replicas)

    # 5. Graceful scale-down: drain the victims before lowering the count.
    for r in render.WORKER_ROLES:
        cur = current[r]
        if cur is not None and desired[r] < cur:
            await _drain_victims(ctx, owner, r, cur - desired[r], now_s)

    # 6. Apply every child.
    applied: dict[tuple[str, str], dict[str, Any]] = {}
    try:
        for obj in render.render_children(owner, spec, desired, fingerprint):
            applied[(obj["kind"], obj["metadata"]["name"])] = await ctx.kube.apply(obj)
        if not spec.networkPolicy.enabled:
            await ctx.kube.delete("networking.k8s.io/v1", "NetworkPolicy", owner.namespace,
                                  naming.network_policy_name(owner))
    except ApiError as e:
        if e.retryable or e.namespace_terminating:
            raise
        return await _degraded(ctx, body, "ApplyFailed", f"{e.status} {e.reason}: {e.message}", "api")

    # 7. Status.
    after = {r: applied.get(("Deployment", naming.child_name(owner, r))) or deps[r] for r in render.ROLES}
    conditions = st.workload_conditions(after) + extra_conditions
    for c in conditions:
        if c["type"] == "Degraded":
            _emit_on_change(ctx, body, "Degraded", "True", c, "Warning", c["reason"])
    new_status: dict[str, Any] = {
        "observedGeneration": generation,
        "conditions": st.merge_conditions(old_status.get("conditions"), conditions, now_s, generation),
        "prefill": st.pool_status(after["prefill"], desired["prefill"]),
        "decode": st.pool_status(after["decode"], desired["decode"]),
        "router": st.pool_status(after["router"], spec.router.replicas),
        "ratio": st.ratio(desired["prefill"], desired["decode"]),
        "endpoint": naming.endpoint(owner),
        "autoscaler": autoscaler_status or None,
    }
    await _patch_status(ctx, body, new_status)
    opmetrics.set_conditions(owner.namespace, owner.name, new_status["conditions"])
    if old_status.get("observedGeneration") != generation:
        ctx.emit(body, "Normal", "Reconciled",
                 f"applied generation {generation}: prefill {desired['prefill']}, decode {desired['decode']}, "
                 f"router {spec.router.replicas} replicas")
    return Outcome(next_delay, new_status, decision)


async def _drain_victims(ctx: Context, owner: naming.Owner, role: str, count: int, now_s: str) -> None:
    pods = await ctx.kube.list("v1", "Pod", owner.namespace, naming.selector_labels(owner, role))
    victims = drain.pick_victims(pods, count)
    http = ctx.http or httpx.AsyncClient(trust_env=False)
    try:
        for pod in victims:
            name = pod["metadata"]["name"]
            await ctx.kube.merge_patch("v1", "Pod", owner.namespace, name, {"metadata": {"annotations": {
                drain.DELETION_COST: drain.VICTIM_COST, drain.DRAINING: now_s}}})
            log.info("draining %s/%s before scaling %s down", owner.namespace, name, role)
        # Ask all victims at once: an unreachable pod costs one short timeout, not one per pod.
        await asyncio.gather(*(drain.drain_pod(pod, http) for pod in victims))
    finally:
        if ctx.http is None:
            await http.aclose()
