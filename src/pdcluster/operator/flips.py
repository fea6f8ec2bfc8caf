"""Pure: role flips carried out by the operator (`spec.roleFlips`, on by default; docs/operator.md).

Flips are used wherever the pools' pods are interchangeable (`blocked` says why not: the RoleFlips condition);
elsewhere a growing pool starts pods, as it always does for what flips cannot cover.

A flip moves a running worker pod from one pool to the other: the worker is told its new role
(`POST /internal/role`, worker/server/role_flip.py), then the pod is relabelled (`pdcluster.dev/role`,
`app.kubernetes.io/component`, `llm-d.ai/role`: the Services', the router's and the endpoint pickers' view).
The relabelled pod leaves its Deployment's selector, so the ReplicaSet releases it; no ReplicaSet adopts it
(its `pod-template-hash` is the old pool's, and it carries the PDCluster as its controller owner, so it is
garbage collected with it). Each pool's size is then its Deployment's pods plus the flipped pods it holds:

- the pool sizes the operator decides (`desired`) count flipped pods; a Deployment's `spec.replicas` is
  `desired - flipped pods of that role` (the old pool's drops by one right after the relabel, so its
  ReplicaSet keeps no replacement, and the new pool starts no pod for what the flip brought);
- flipped pods are the first removed when their pool shrinks (drained, then deleted: no ReplicaSet owns them);
- a flipped pod that a pod of its pool would not be now (`stale`: flips turned off, pools no longer
  interchangeable, or the template it came from changed, e.g. an image upgrade) is replaced: it no longer
  counts, so its pool's Deployment starts a pod for it, and once that Deployment has every replica ready the
  flipped pod is drained and removed (a rolling update's surge, one pod at a time per pass).

How many flips a pass makes: the growing pool's growth, at most what the other pool gives up (the autoscaler's
`autoscaler_flip.plan` already shrank it by its slack; with autoscaling off, the spec's sizes); fewer if the
worker cannot finish what it holds in time (the growing pool then starts pods for the rest).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdcluster.operator import naming, render
from pdcluster.operator import status as st
from pdcluster.operator.models import PDClusterSpec

ROLES = naming.WORKER_ROLES
FLIPPED = "pdcluster.dev/flipped-from"  # label on a flipped pod: the pool it came from
FLIPPED_AT = "pdcluster.dev/flipped-at"  # annotation: when
ORIGIN = "pdcluster.dev/flipped-template"  # annotation: "<pool>/<template_hash>" the pod was made from
COMPONENT_LABEL = "app.kubernetes.io/component"
LLMD_ROLE_LABEL = "llm-d.ai/role"
FLIP_CAUSE = "flip"


@dataclass(frozen=True)
class Order:
    """`count` running workers of `source` to become `target` workers in this pass."""

    source: str
    target: str
    count: int


def other(role: str) -> str:
    return "decode" if role == "prefill" else "prefill"


@dataclass(frozen=True)
class Blocked:
    """Why the pools' pods cannot swap roles: the RoleFlips condition's reason (CamelCase) and message."""

    reason: str
    message: str


# what a flipped pod keeps from its old pool besides image, resources and layout: the pool fields that shape
# how its process runs or where it may be placed (podAnnotations and imagePullSecrets do neither once it runs)
POD_FIELDS = ("engineArgs", "env", "affinity", "priorityClassName")
PODS_START = "a growing pool starts pods"


def blocked(spec: PDClusterSpec) -> Blocked | None:
    """Why flips are off for this spec (None: the pools' pods are interchangeable, flips are used). A flipped
    pod keeps its pod spec: same engine flags except the role and batch limits (which the flip sets), same
    resources, image, layout and pod options."""
    if not spec.roleFlips:
        return Blocked("Disabled", f"spec.roleFlips is false: {PODS_START}")
    if spec.engine != "pdcluster":
        return Blocked("EngineUnsupported", f"engine {spec.engine}: its workers cannot change role without a "
                       f"restart; {PODS_START}")
    p, d = spec.prefill, spec.decode
    layout = {r: (spec.pool(r).tensorParallelSize, spec.gpus_per_pod(r)) for r in ROLES}
    if layout["prefill"] != layout["decode"]:
        (tp_p, g_p), (tp_d, g_d) = layout["prefill"], layout["decode"]
        return Blocked("LayoutsDiffer", f"prefill runs tensorParallelSize {tp_p} ({g_p} GPUs per pod), decode "
                       f"{tp_d} ({g_d}): {PODS_START}")
    if p.resources.model_dump() != d.resources.model_dump():
        return Blocked("ResourcesDiffer", f"spec.prefill.resources and spec.decode.resources differ: {PODS_START}")
    if (ip := spec.pool_image("prefill")) != (id_ := spec.pool_image("decode")):
        return Blocked("ImagesDiffer", f"prefill image {ip}, decode image {id_}: {PODS_START}")
    differ = [f for f in POD_FIELDS if _dump(getattr(p, f)) != _dump(getattr(d, f))]
    if differ:
        return Blocked("PodSpecsDiffer", f"spec.prefill and spec.decode differ in {', '.join(differ)}: "
                       f"{PODS_START}")
    return None


def _dump(v: Any) -> Any:
    if isinstance(v, list):
        return [_dump(x) for x in v]
    return v.model_dump() if hasattr(v, "model_dump") else v


def incompatible(spec: PDClusterSpec) -> str | None:
    """Why the pools' pods cannot swap roles (None: they can): `blocked`'s message."""
    b = blocked(spec)
    return None if b is None else b.message


def condition(spec: PDClusterSpec) -> dict[str, Any]:
    """The RoleFlips condition: True while a pool grows by flips first, False with the reason it cannot."""
    b = blocked(spec)
    if b is None:
        return st.condition("RoleFlips", True, "PoolsInterchangeable",
                            "a growing pool first takes running workers of the other pool (a role flip, no "
                            "restart) where that pool shrinks or, with autoscaling, has slack; pods start for "
                            "the rest")
    return st.condition("RoleFlips", False, b.reason, b.message)


def order(spec: PDClusterSpec, current: Mapping[str, int | None], desired: Mapping[str, int]) -> Order | None:
    """The flips of this pass: one pool grows while the other shrinks; None when there are none."""
    if incompatible(spec) is not None:
        return None
    for target in ROLES:
        source = other(target)
        cur_t, cur_s = current.get(target), current.get(source)
        if cur_t is None or cur_s is None:
            continue  # a pool being created: nothing runs to flip
        n = min(desired[target] - cur_t, cur_s - desired[source])
        if n > 0:
            return Order(source, target, n)
    return None


def settle(desired: Mapping[str, int], current: Mapping[str, int | None], o: Order, done: int,
           source_without_flips: int | None = None, target_without_flips: int | None = None) -> dict[str, int]:
    """The sizes once `done` of `o.count` flips succeeded: the target pool keeps its size (pods start for the
    flips that failed) unless it was not meant to grow by pods (`target_without_flips`: the autoscaler's size
    for it before the flips were planned, e.g. its size now for the flip-only step of
    `autoscaler_flip_window`: it grows by what flipped only); the source pool gives up only what flipped,
    unless it was meant to shrink anyway (`source_without_flips`: as for the target; None: the spec's)."""
    out = dict(desired)
    if done < o.count and source_without_flips is not None:
        cur = current.get(o.source) or 0
        out[o.source] = max(desired[o.source], min(source_without_flips, cur - done))
    if done < o.count and target_without_flips is not None:
        cur = current.get(o.target) or 0
        out[o.target] = min(desired[o.target], max(target_without_flips, cur + done))
    return out


def deployment_replicas(desired: Mapping[str, int], flipped: Mapping[str, int]) -> dict[str, int]:
    """Each pool's Deployment replicas: its size less the flipped pods it holds (no ReplicaSet owns those)."""
    return {r: max(0, desired[r] - flipped.get(r, 0)) for r in desired}


def is_flipped(pod: Mapping[str, Any]) -> bool:
    meta = pod.get("metadata") or {}
    return FLIPPED in (meta.get("labels") or {}) and not meta.get("deletionTimestamp")


def flipped_counts(pods_by_role: Mapping[str, list[dict[str, Any]]]) -> dict[str, int]:
    return {r: sum(1 for p in pods_by_role.get(r, []) if is_flipped(p)) for r in ROLES}


def relabel_patch(owner: naming.Owner, source: str, target: str, now: str,
                  origin: str | None = None) -> dict[str, Any]:
    """The merge patch of a pod that now serves `target`: its role labels, where it came from, and the
    PDCluster as its controller (the old ReplicaSet's reference goes: nothing adopts it or replaces it);
    `origin` (`origin_of`, on a pod's first flip only): the pod template it was made from."""
    labels = {naming.ROLE_LABEL: target, COMPONENT_LABEL: target, LLMD_ROLE_LABEL: target, FLIPPED: source}
    annotations = {FLIPPED_AT: now, **({ORIGIN: origin} if origin else {})}
    return {"metadata": {"labels": labels, "annotations": annotations,
                         "ownerReferences": [naming.owner_reference(owner)]}}


def template_hash(deployment: Mapping[str, Any]) -> str:
    """A short hash of a rendered Deployment's pod template (what its pods are made from)."""
    return render._hash(deployment["spec"]["template"])


def template_hashes(owner: naming.Owner, spec: PDClusterSpec, kv_secret_fingerprint: str) -> dict[str, str]:
    """Each worker pool's pod template now, less the batch limits (a flip sets a worker's to its new pool's,
    so a change of them makes no flipped pod stale)."""
    def no_limits(pool: Any) -> Any:
        return pool.model_copy(update={"maxBatchSize": 1, "maxBatchTokens": 1})

    neutral = spec.model_copy(update={"prefill": no_limits(spec.prefill), "decode": no_limits(spec.decode)})
    return {r: template_hash(render.render_worker_deployment(owner, neutral, r, 1, kv_secret_fingerprint))
            for r in ROLES}


def origin_of(role: str, hashes: Mapping[str, str]) -> str:
    """The ORIGIN annotation of a pod of `role`'s Deployment flipped now: its pool and that pool's template."""
    return f"{role}/{hashes[role]}"


def stale(pod: Mapping[str, Any], hashes: Mapping[str, str], flips_blocked: bool) -> bool:
    """A flipped pod that a pod of its pool would not be now, so it is replaced (a pod of its pool's Deployment
    starts first, then it is drained and removed): flips are off or the pools stopped being interchangeable,
    or the template of the pool it came from changed since its flip (an image upgrade, a new KV setting).
    A flipped pod without ORIGIN (flipped by an operator before it) counts as current."""
    if not is_flipped(pod):
        return False
    if flips_blocked:
        return True
    origin = ((pod.get("metadata") or {}).get("annotations") or {}).get(ORIGIN) or ""
    role, _, h = origin.partition("/")
    return role in hashes and bool(h) and hashes[role] != h


def pick_flippers(pods: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """Pods of the source pool to flip, best first: ready, serving (not being drained or deleted), with an
    address; pods that were flipped into it before go back first (they are the ones no ReplicaSet owns)."""
    from pdcluster.operator import drain

    def usable(p: dict[str, Any]) -> bool:
        meta = p.get("metadata") or {}
        return (drain._ready(p) and not meta.get("deletionTimestamp")
                and drain.DRAINING not in (meta.get("annotations") or {})
                and bool((p.get("status") or {}).get("podIP")))

    ok = [p for p in pods if usable(p)]
    return sorted(ok, key=lambda p: (0 if is_flipped(p) else 1, (p.get("metadata") or {}).get("name", "")))[:count]


def retire_first(pods: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """Flipped pods to remove when their pool shrinks by `count` (before any pod of its Deployment)."""
    return sorted((p for p in pods if is_flipped(p)), key=lambda p: (p.get("metadata") or {}).get("name", ""))[:count]
