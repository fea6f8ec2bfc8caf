"""Graceful scale-down: choose the pods to remove, ask them to drain, make the ReplicaSet remove them.

Before a pool shrinks from N to N-k the operator picks k victims, marks each with
`controller.kubernetes.io/pod-deletion-cost` (lower = deleted first by the ReplicaSet controller) and
`pdcluster.dev/draining`, and POSTs `/drain` to it (the worker stops taking new work and finishes
in-flight requests and transfers; its readiness drops so Services stop routing to it). The call carries
the bearer token derived from the cluster's KV secret, as /internal/* calls do: a worker refuses an
unauthenticated drain, and `/undrain` reverses one. Only then is the
Deployment's replica count lowered. Pods already marked are chosen first, so a scale-down interrupted by
an error picks the same pods next time.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx

from pdcluster.operator import opmetrics
from pdcluster.operator.models import WORKER_PORT
from pdcluster.worker.transfer.secret import internal_headers  # stdlib only: no torch in the operator

log = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
DRAINING = "pdcluster.dev/draining"
VICTIM_COST = "-1000"


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
