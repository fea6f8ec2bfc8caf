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
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from pydantic import ValidationError

from pdcluster.operator import autoscaler as asc
from pdcluster.operator import drain, flip_pods, flips, naming, opmetrics, render, scaling
from pdcluster.operator import status as st
from pdcluster.operator.kube import PDC_API_VERSION, ApiError, Kube
from pdcluster.operator.models import KIND, PDClusterSpec, parse_spec, short_error
from pdcluster.operator.promsource import PrometheusSource

log = logging.getLogger(__name__)

RESYNC_SECONDS = 60.0


EmitFn = Callable[[dict[str, Any], str, str, str], None]

_sources: dict[str, PrometheusSource] = {}


def default_source(url: str) -> scaling.MetricsSource:
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
    source_for: Callable[[str], scaling.MetricsSource] = default_source
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

    # 3. What runs now; 4. desired replicas (the operator is their single writer).
    deps, pools = await _read_pools(ctx, owner)
    # the pools count their flipped pods (stale ones, to be replaced, aside); each pool's pod template now
    fp = await flip_pods.FlipPass.read(ctx.kube, owner, spec, flips.template_hashes(owner, spec, fingerprint))
    sizes, ready = fp.pools(pools.current, pools.ready)
    pools = dataclasses.replace(pools, current=sizes, ready=ready)
    scale = await _scaling_step(ctx, body, owner, spec, old_status, pools, now)
    # 4b. role flips (where the pools are interchangeable): workers move pools before any pod starts or stops
    desired, current = await _flip(ctx, body, fp, pools.current, scale.desired, scale.before_flips, key, now_s)

    # 5. Graceful scale-down: drain the victims before lowering the count (flipped pods go first).
    for r in render.WORKER_ROLES:
        cur = current[r]
        if cur is not None and desired[r] < cur:
            gone = await _retire_flipped(ctx, fp, r, cur - desired[r], key)
            if cur - gone > desired[r]:
                await _drain_victims(ctx, owner, r, cur - gone - desired[r], now_s, key)

    # 6. Apply every child (a Deployment runs its pool less the flipped pods it holds).
    try:
        replicas = flips.deployment_replicas(desired, fp.flipped)
        applied = await _apply_children(ctx, owner, spec, replicas, fingerprint)
    except ApiError as e:
        if e.retryable or e.namespace_terminating:
            raise
        return await _degraded(ctx, body, "ApplyFailed", f"{e.status} {e.reason}: {e.message}", "api")

    # 7. Status.
    after = {r: applied.get(("Deployment", naming.child_name(owner, r))) or deps[r] for r in render.ROLES}
    if any(fp.stale.values()):  # stale flipped pods go once their Deployment runs their replacements ready
        await _replace_stale(ctx, body, fp, after, key)
    after = fp.count_in(after)  # the pools with their flipped pods
    conditions = st.workload_conditions(after) + scale.conditions + [flips.condition(spec)]
    for c in conditions:
        if c["type"] == "Degraded":
            _emit_on_change(ctx, body, "Degraded", "True", c, "Warning", c["reason"])
    new_status = st.pdcluster_status(
        generation=generation, old_conditions=old_status.get("conditions"), conditions=conditions,
        deployments=after, desired=desired, router_replicas=spec.router.replicas,
        endpoint=naming.endpoint(owner), autoscaler=scale.autoscaler_status, now=now_s,
        layouts={r: (spec.pool(r).tensorParallelSize, spec.gpus_per_pod(r)) for r in render.WORKER_ROLES},
        flipped=fp.flipped_pods())
    await _patch_status(ctx, body, new_status)
    opmetrics.set_conditions(owner.namespace, owner.name, new_status["conditions"])
    if old_status.get("observedGeneration") != generation:
        ctx.emit(body, "Normal", "Reconciled",
                 f"applied generation {generation}: prefill {desired['prefill']}, decode {desired['decode']}, "
                 f"router {spec.router.replicas} replicas")
    return Outcome(scale.next_delay, new_status, scale.decision)


async def _read_pools(ctx: Context, owner: naming.Owner
                      ) -> tuple[dict[str, dict[str, Any] | None], scaling.Pools]:
    """The three Deployments as they are, and the worker pools as the scaling step sees them."""
    deps = {r: await ctx.kube.get("apps/v1", "Deployment", owner.namespace, naming.child_name(owner, r))
            for r in render.ROLES}
    return deps, scaling.Pools(
        current={r: (st.deployment_replicas(deps[r])[0] if deps[r] else None) for r in render.WORKER_ROLES},
        ready={r: st.deployment_replicas(deps[r])[2] for r in render.WORKER_ROLES},
        created={r: _creation_time(deps[r]) for r in render.WORKER_ROLES},
    )


async def _scaling_step(ctx: Context, body: dict[str, Any], owner: naming.Owner, spec: PDClusterSpec,
                        old_status: dict[str, Any], pools: scaling.Pools, now: float) -> scaling.Step:
    """`scaling.step` plus its side effects: Warning Events on bad conditions, the Scaled Event, metrics."""
    scale = await scaling.step(spec, old_status, pools, now, cluster=owner.name, source_for=ctx.source_for,
                               resync_seconds=ctx.resync_seconds)
    for c in scale.conditions:
        bad_status, reason = scaling.WARN_WHEN[c["type"]]
        _emit_on_change(ctx, body, c["type"], bad_status, c, "Warning", reason)
    if scale.scaled_message:
        ctx.emit(body, "Normal", "Scaled", scale.scaled_message)
    scaling.record_metrics(owner, spec, scale)
    return scale


async def _apply_children(ctx: Context, owner: naming.Owner, spec: PDClusterSpec, desired: dict[str, int],
                          fingerprint: str) -> dict[tuple[str, str], dict[str, Any]]:
    """Server-side apply every child; (kind, name) -> the object the API server returned."""
    applied: dict[tuple[str, str], dict[str, Any]] = {}
    for obj in render.render_children(owner, spec, desired, fingerprint):
        applied[(obj["kind"], obj["metadata"]["name"])] = await ctx.kube.apply(obj)
    if not spec.networkPolicy.enabled:
        await ctx.kube.delete("networking.k8s.io/v1", "NetworkPolicy", owner.namespace,
                              naming.network_policy_name(owner))
    return applied


async def _flip(ctx: Context, body: dict[str, Any], fp: flip_pods.FlipPass, current: dict[str, int | None],
                desired: dict[str, int], before_flips: dict[str, int] | None, key: bytes | None, now_s: str
                ) -> tuple[dict[str, int], dict[str, int | None]]:
    http = ctx.http or httpx.AsyncClient(trust_env=False)
    try:
        return await fp.run(http, current, desired, before_flips, key, now_s,
                            lambda type_, reason, message: ctx.emit(body, type_, reason, message))
    finally:
        if ctx.http is None:
            await http.aclose()


async def _replace_stale(ctx: Context, body: dict[str, Any], fp: flip_pods.FlipPass,
                         deps: dict[str, dict[str, Any] | None], key: bytes | None) -> None:
    http = ctx.http or httpx.AsyncClient(trust_env=False)
    try:
        await fp.replace_stale(http, deps, key, lambda type_, reason, message: ctx.emit(body, type_, reason, message))
    finally:
        if ctx.http is None:
            await http.aclose()


async def _retire_flipped(ctx: Context, fp: flip_pods.FlipPass, role: str, count: int,
                          key: bytes | None) -> int:
    if not fp.flipped.get(role):
        return 0
    http = ctx.http or httpx.AsyncClient(trust_env=False)
    try:
        return await fp.retire(http, role, count, key)
    finally:
        if ctx.http is None:
            await http.aclose()


async def _drain_victims(ctx: Context, owner: naming.Owner, role: str, count: int, now_s: str,
                         key: bytes | None = None) -> None:
    pods = await ctx.kube.list("v1", "Pod", owner.namespace, naming.selector_labels(owner, role))
    victims = drain.pick_victims(pods, count)
    http = ctx.http or httpx.AsyncClient(trust_env=False)
    try:
        for pod in victims:
            name = pod["metadata"]["name"]
            await ctx.kube.merge_patch("v1", "Pod", owner.namespace, name, {"metadata": {"annotations": {
                drain.DELETION_COST: drain.VICTIM_COST, drain.DRAINING: now_s}}})
            log.info("draining %s/%s before scaling %s down", owner.namespace, name, role)
        # Ask all victims at once and wait until none has anything in flight (a prefill's KV sends included):
        # an unreachable pod costs one short timeout. The workers refuse /drain without the bearer token
        # derived from the KV secret.
        results = await asyncio.gather(*(drain.drain_and_wait(pod, http, secret=key) for pod in victims))
        target = {"apiVersion": owner.api_version, "kind": owner.kind,
                  "metadata": {"name": owner.name, "namespace": owner.namespace, "uid": owner.uid}}
        for res in results:  # a pod that did not take the drain (gone, or vLLM's: its preStop drains) is logged
            if res.answered:
                ctx.emit(target, "Normal" if res.idle else "Warning", "Drained" if res.idle else "DrainIncomplete",
                         res.message(role))
    finally:
        if ctx.http is None:
            await http.aclose()
