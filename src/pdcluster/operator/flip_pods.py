"""Role flips on real pods: ask the workers, relabel the pods, retire flipped pods first on scale-down
(the pure rules are in flips.py)."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Callable
from typing import Any

import httpx

from pdcluster.operator import drain, flips, naming
from pdcluster.operator import status as st
from pdcluster.operator.models import WORKER_PORT, PDClusterSpec
from pdcluster.worker.transfer.secret import internal_headers  # stdlib only: no torch in the operator

log = logging.getLogger(__name__)
WORKER_FLIP_TIMEOUT_S = 60.0  # how long a worker may take to finish what it holds before it flips
EmitFn = Callable[[str, str, str], None]  # (type, reason, message) on the PDCluster


def worker_port(pod: dict[str, Any]) -> int:
    """The worker's port: its container port named `http` (the rendered pods'), else the default."""
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == "http" and isinstance(p.get("containerPort"), int):
                return int(p["containerPort"])
    return WORKER_PORT


async def ask_worker(pod: dict[str, Any], role: str, spec: PDClusterSpec, http: httpx.AsyncClient,
                     secret: bytes | None) -> tuple[bool, str]:
    """POST /internal/role to the pod's worker: (flipped, what it said)."""
    ip, port = (pod.get("status") or {}).get("podIP"), worker_port(pod)
    pool = spec.pool(role)
    body = {"role": role, "timeout_s": WORKER_FLIP_TIMEOUT_S, "max_batch_size": pool.maxBatchSize,
            "max_batch_tokens": pool.maxBatchTokens}
    try:
        r = await http.post(f"http://{ip}:{port}/internal/role", json=body, headers=internal_headers(secret),
                            timeout=httpx.Timeout(WORKER_FLIP_TIMEOUT_S + 10, connect=3.0))  # gone: fail fast
    except httpx.HTTPError as e:
        return False, f"{type(e).__name__}: {e}"
    if r.status_code != 200:
        return False, f"HTTP {r.status_code}: {r.text[:300]}"
    got = r.json()
    return got.get("role") == role, f"{got.get('previous')} -> {got.get('role')} in {got.get('seconds', 0):.2f} s"


async def pool_pods(kube: Any, owner: naming.Owner) -> dict[str, list[dict[str, Any]]]:
    return {r: await kube.list("v1", "Pod", owner.namespace, naming.selector_labels(owner, r)) for r in flips.ROLES}


async def carry_out(kube: Any, http: httpx.AsyncClient, owner: naming.Owner, spec: PDClusterSpec, o: flips.Order,
                    pods: list[dict[str, Any]], secret: bytes | None, now_s: str, emit: EmitFn,
                    hashes: dict[str, str] | None = None) -> int:
    """Flip up to `o.count` of the source pool's `pods`; how many flipped (relabelled: the router and the
    Services follow the label). A worker that answers anything but its new role is left as it is. `hashes`:
    each pool's pod template now (`flips.template_hash`), recorded on a pod at its first flip."""
    chosen = flips.pick_flippers(pods, o.count)
    answers = await asyncio.gather(*(ask_worker(p, o.target, spec, http, secret) for p in chosen))
    done = 0
    for pod, (ok, said) in zip(chosen, answers, strict=True):
        name = pod["metadata"]["name"]
        if not ok:
            log.warning("role flip of %s/%s to %s failed: %s", owner.namespace, name, o.target, said)
            emit("Warning", "RoleFlipFailed", f"pod {name}: {o.source} -> {o.target} not done ({said[:200]}); "
                 f"the {o.target} pool starts a pod instead")
            continue
        owned = not flips.is_flipped(pod)  # its ReplicaSet's: that one would replace it
        origin = flips.origin_of(o.source, hashes) if owned and hashes and o.source in hashes else None
        await kube.merge_patch("v1", "Pod", owner.namespace, name,
                               flips.relabel_patch(owner, o.source, o.target, now_s, origin))
        done += 1
        if owned:  # at once, not at the end of the pass: a replacement its ReplicaSet made meanwhile goes again
            await shrink_deployment(kube, owner, o.source)
        log.info("role flip %s/%s: %s", owner.namespace, name, said)
        emit("Normal", "RoleFlip", f"pod {name}: {said} (flip, no restart)")
    return done


async def shrink_deployment(kube: Any, owner: naming.Owner, role: str) -> None:
    """The pool's Deployment one replica down: a pod of it left by a flip (the pass's apply agrees)."""
    dep = await kube.get("apps/v1", "Deployment", owner.namespace, naming.child_name(owner, role))
    n = int(((dep or {}).get("spec") or {}).get("replicas") or 0)
    if n > 0:
        await kube.merge_patch("apps/v1", "Deployment", owner.namespace, naming.child_name(owner, role),
                               {"spec": {"replicas": n - 1}})


async def ensure_roles(http: httpx.AsyncClient, spec: PDClusterSpec, pods: dict[str, list[dict[str, Any]]],
                       secret: bytes | None) -> None:
    """A flipped pod whose container restarted comes back with its old `--role`: tell it its label's role
    again (idempotent: a worker already in that role answers at once)."""
    calls = [ask_worker(p, r, spec, http, secret) for r in flips.ROLES for p in pods.get(r, [])
             if flips.is_flipped(p) and drain._ready(p) and (p.get("status") or {}).get("podIP")]
    for ok, said in await asyncio.gather(*calls):
        if not ok:
            log.warning("a flipped pod did not confirm its role: %s", said)


async def retire(kube: Any, http: httpx.AsyncClient, owner: naming.Owner, pods: list[dict[str, Any]], count: int,
                 secret: bytes | None) -> list[str]:
    """Remove up to `count` flipped pods of a shrinking pool (drained first, as a Deployment's victims are);
    the names of those that went."""
    victims = flips.retire_first(pods, count)
    await asyncio.gather(*(drain.drain_pod(p, http, port=worker_port(p), secret=secret) for p in victims))
    for p in victims:
        name = p["metadata"]["name"]
        log.info("removing flipped pod %s/%s (its pool shrinks)", owner.namespace, name)
        await kube.delete("v1", "Pod", owner.namespace, name)
    return [p["metadata"]["name"] for p in victims]


class FlipPass:
    """One reconcile pass's role flips: the pools as flips leave them, the flips to make, the flipped pods
    to retire first, the stale flipped pods to replace. Flips are made only where the pools are
    interchangeable (`flips.blocked`); the pods are read on every pass all the same, so that pods flipped
    before `spec.roleFlips` was turned off (or before the pools stopped being interchangeable, or before the
    template they came from changed) are replaced by pods of their pool's Deployment (`flips.stale`)."""

    def __init__(self, kube: Any, owner: naming.Owner, spec: PDClusterSpec,
                 pods: dict[str, list[dict[str, Any]]], hashes: dict[str, str] | None = None) -> None:
        self.kube, self.owner, self.spec, self.pods = kube, owner, spec, pods
        self.hashes = hashes or {}
        self._count()

    def _count(self) -> None:
        """`stale`: each pool's flipped pods to replace; `flipped`: those it keeps (counted in its size; a
        Deployment runs its pool less these)."""
        off = flips.blocked(self.spec) is not None
        self.stale = {r: [p for p in self.pods.get(r, []) if flips.stale(p, self.hashes, off)] for r in flips.ROLES}
        gone = {r: {p["metadata"]["name"] for p in self.stale[r]} for r in flips.ROLES}
        self.kept = {r: [p for p in self.pods.get(r, []) if p["metadata"]["name"] not in gone[r]]
                     for r in flips.ROLES}
        self.flipped = flips.flipped_counts(self.kept)

    @classmethod
    async def read(cls, kube: Any, owner: naming.Owner, spec: PDClusterSpec,
                   hashes: dict[str, str] | None = None) -> FlipPass:
        return cls(kube, owner, spec, await pool_pods(kube, owner), hashes)

    def pools(self, current: dict[str, int | None], ready: dict[str, int]
              ) -> tuple[dict[str, int | None], dict[str, int]]:
        """Each pool's size and ready count with the flipped pods it keeps (which no Deployment counts; the
        stale ones are on their way out, like the surplus pods of a rolling update)."""
        cur = {r: (None if c is None else c + self.flipped[r]) for r, c in current.items()}
        rdy = {r: ready[r] + sum(1 for p in self.kept[r] if flips.is_flipped(p) and drain._ready(p))
               for r in ready}
        return cur, rdy

    async def run(self, http: httpx.AsyncClient, current: dict[str, int | None], desired: dict[str, int],
                  before_flips: dict[str, int] | None, secret: bytes | None, now_s: str, emit: EmitFn
                  ) -> tuple[dict[str, int], dict[str, int | None]]:
        """Carry out this pass's flips: (the pool sizes, each pool's size now that they are done)."""
        await ensure_roles(http, self.spec, self.pods, secret)
        o = flips.order(self.spec, current, desired)
        if o is None:
            return desired, current
        done = await carry_out(self.kube, http, self.owner, self.spec, o, self.kept[o.source], secret, now_s, emit,
                               self.hashes)
        if done:
            self.pods = await pool_pods(self.kube, self.owner)  # the relabelled pods moved pools
            self._count()
        sizes = flips.settle(desired, current, o, done,
                             None if before_flips is None else before_flips[o.source],
                             None if before_flips is None else before_flips[o.target])
        after = dict(current)
        after[o.source] = (current[o.source] or 0) - done
        after[o.target] = (current[o.target] or 0) + done
        return sizes, after

    async def retire(self, http: httpx.AsyncClient, role: str, count: int, secret: bytes | None) -> int:
        """The shrinking pool loses its flipped pods first; how many of `count` that was."""
        gone = await retire(self.kube, http, self.owner, self.kept[role], count, secret)
        self.pods[role] = [p for p in self.pods[role] if p["metadata"]["name"] not in gone]
        self._count()
        return len(gone)

    async def replace_stale(self, http: httpx.AsyncClient, deps: dict[str, dict[str, Any] | None],
                            secret: bytes | None, emit: EmitFn) -> list[str]:
        """Remove (drained first) the stale flipped pods of each pool whose Deployment has rolled out every
        replica ready: it runs their replacements (it was applied with them counted out). The names gone."""
        gone: list[str] = []
        why = flips.incompatible(self.spec) or "the pool it came from has a new pod template"
        for r in flips.ROLES:
            if not self.stale[r] or st.rollout_state(deps.get(r))[0]:
                continue  # none, or its replacements are not all ready yet: it keeps serving meanwhile
            names = await retire(self.kube, http, self.owner, self.stale[r], len(self.stale[r]), secret)
            for name in names:
                emit("Normal", "FlippedPodReplaced", f"{r} pod {name} (flipped) replaced by a pod of "
                     f"{naming.child_name(self.owner, r)}: {why}")
            self.pods[r] = [p for p in self.pods[r] if p["metadata"]["name"] not in names]
            gone += names
        self._count()
        return gone

    def count_in(self, deps: dict[str, dict[str, Any] | None]) -> dict[str, dict[str, Any] | None]:
        """The Deployments as the status shows the pools: each with the flipped pods its pool holds (so a pool
        whose workers all came by flips is not `0/0`, not ready)."""
        out = dict(deps)
        for r in flips.ROLES:
            dep, ps = deps.get(r), [p for p in self.pods.get(r, []) if flips.is_flipped(p)]
            if dep is None or not ps:
                continue
            dep = copy.deepcopy(dep)
            spec, status = dep.setdefault("spec", {}), dep.setdefault("status", {})
            spec["replicas"] = int(spec.get("replicas") or 0) + len(ps)
            status["replicas"] = int(status.get("replicas") or 0) + len(ps)
            status["readyReplicas"] = int(status.get("readyReplicas") or 0) + sum(1 for p in ps if drain._ready(p))
            out[r] = dep
        return out

    def flipped_pods(self) -> dict[str, int]:
        """Each pool's flipped pods, stale ones included (status.<pool>.flippedReplicas)."""
        return flips.flipped_counts(self.pods)
