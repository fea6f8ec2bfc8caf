"""Graceful scale-down: choose the pods to remove, ask them to drain, make the ReplicaSet remove them.

Before a pool shrinks from N to N-k the operator picks k victims, marks each with
`controller.kubernetes.io/pod-deletion-cost` (lower = deleted first by the ReplicaSet controller) and
`pdcluster.dev/draining`, and POSTs `/drain?wait=true` to it (the worker stops taking new work and
finishes in-flight requests and transfers; its readiness drops so Services stop routing to it). The call
returns once nothing of the pod is in flight, a prefill's KV sends included, so no decode worker still
needs the KV of a pod that is about to go (or after `DRAIN_WAIT_S`: then the pod's own graceful stop on
SIGTERM finishes what is left). The call carries the bearer token derived from the cluster's KV secret, as
/internal/* calls do: a worker refuses an unauthenticated drain, and `/undrain` reverses one. Only then is
the Deployment's replica count lowered. Pods already marked are chosen first, so a scale-down interrupted
by an error picks the same pods next time. Each victim's drain is a `Drained` Event (or `DrainIncomplete`,
a Warning) on the PDCluster: what it had in flight when asked and how long it took.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

from pdcluster.operator import opmetrics
from pdcluster.operator.models import WORKER_PORT
from pdcluster.worker.transfer.secret import internal_headers  # stdlib only: no torch in the operator

log = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
DRAINING = "pdcluster.dev/draining"
VICTIM_COST = "-1000"
# How long one scale-down waits for its victims' in-flight work (the reconcile of that PDCluster waits with
# it): a KV send takes well under a second; what is left after this the pod's SIGTERM grace period covers.
DRAIN_WAIT_S = 30.0


def _ready(pod: dict[str, Any]) -> bool:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


def pick_victims(pods: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """Pods to remove, best first: already draining, then not scheduled/not ready, then the youngest
    (least warm caches, least likely to hold long-running requests)."""
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]

    def key(p: dict[str, Any]) -> tuple[int, int, int, str, str]:
        meta = p.get("metadata") or {}
        draining = 0 if DRAINING in (meta.get("annotations") or {}) else 1
        scheduled = 1 if (p.get("spec") or {}).get("nodeName") else 0
        ready = 1 if _ready(p) else 0
        created = meta.get("creationTimestamp") or ""
        # newest first: invert the timestamp ordering via a negative sort on a second pass
        return (draining, scheduled, ready, "".join(chr(0x10FFFF - ord(ch)) for ch in created),
                meta.get("name", ""))

    return sorted(live, key=key)[: max(0, count)]


async def drain_pod(pod: dict[str, Any], http: httpx.AsyncClient, port: int = WORKER_PORT,
                    secret: bytes | None = None) -> bool:
    ip = (pod.get("status") or {}).get("podIP")
    name = (pod.get("metadata") or {}).get("name")
    if not ip:
        opmetrics.DRAINS.labels("no_ip").inc()
        return False
    host = f"[{ip}]" if ":" in ip else ip
    try:
        resp = await http.post(f"http://{host}:{port}/drain", timeout=httpx.Timeout(5.0, connect=2.0),
                               headers=internal_headers(secret))
        ok = resp.status_code < 400
        opmetrics.DRAINS.labels("ok" if ok else f"http_{resp.status_code}").inc()
        if not ok:
            log.warning("drain %s: HTTP %s", name, resp.status_code)
        return ok
    except httpx.HTTPError as e:
        opmetrics.DRAINS.labels("error").inc()
        log.warning("drain %s (%s) failed: %s", name, ip, e)
        return False


@dataclass(frozen=True)
class Drained:
    """One victim's answer to `/drain?wait=true`."""

    pod: str
    answered: bool  # the pod took the drain (else: unreachable, refused, or not our worker)
    idle: bool  # nothing of it was in flight any more when it answered
    in_flight_at_drain: int | None  # requests (a prefill's: with their KV sends) in flight when asked
    seconds: float
    error: str | None = None

    def message(self, role: str) -> str:
        held = "" if self.in_flight_at_drain is None else f", {self.in_flight_at_drain} request(s) in flight when asked"
        if self.idle:
            return f"{role} pod {self.pod} drained: idle after {self.seconds:.1f} s{held}"
        why = self.error or f"still busy after {self.seconds:.1f} s (its SIGTERM grace period finishes the rest)"
        return f"{role} pod {self.pod} not drained: {why}{held}"


async def drain_and_wait(pod: dict[str, Any], http: httpx.AsyncClient, wait_s: float = DRAIN_WAIT_S,
                         port: int = WORKER_PORT, secret: bytes | None = None) -> Drained:
    """Ask the pod to drain and wait (at most `wait_s`) until it has nothing in flight."""
    ip = (pod.get("status") or {}).get("podIP")
    name = str((pod.get("metadata") or {}).get("name"))
    t0 = time.monotonic()
    if not ip:
        opmetrics.DRAINS.labels("no_ip").inc()
        return Drained(name, False, False, None, 0.0, "no pod IP")
    host = f"[{ip}]" if ":" in ip else ip
    try:
        resp = await http.post(f"http://{host}:{port}/drain", params={"wait": "true", "timeout": str(wait_s)},
                               timeout=httpx.Timeout(wait_s + 10.0, connect=2.0), headers=internal_headers(secret))
    except httpx.HTTPError as e:
        opmetrics.DRAINS.labels("error").inc()
        log.warning("drain %s (%s) failed: %s", name, ip, e)
        return Drained(name, False, False, None, time.monotonic() - t0, f"{type(e).__name__}: {e}")
    seconds = time.monotonic() - t0
    if resp.status_code >= 400:
        opmetrics.DRAINS.labels(f"http_{resp.status_code}").inc()
        log.warning("drain %s: HTTP %s", name, resp.status_code)
        return Drained(name, False, False, None, seconds, f"HTTP {resp.status_code}")
    try:
        answer = resp.json()
    except ValueError:
        answer = {}
    answer = answer if isinstance(answer, dict) else {}
    idle, at_drain = answer.get("idle") is True, answer.get("in_flight_at_drain")
    opmetrics.DRAINS.labels("ok" if idle else "busy").inc()
    return Drained(name, True, idle, at_drain if isinstance(at_drain, int) else None, seconds)
