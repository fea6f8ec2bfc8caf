"""Pure status computation: conditions (with stable lastTransitionTime), per-pool replicas, ratio."""

from __future__ import annotations

import datetime as dt
from typing import Any

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "MetricsAvailable", "ScalingLimited")


def fmt_time(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str) -> float:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def condition(type_: str, status: bool | str, reason: str, message: str) -> dict[str, Any]:
    s = status if isinstance(status, str) else ("True" if status else "False")
    return {"type": type_, "status": s, "reason": reason, "message": message}


def merge_conditions(old: list[dict[str, Any]] | None, new: list[dict[str, Any]], now: str,
                     generation: int | None) -> list[dict[str, Any]]:
    """New conditions in CONDITION_TYPES order; lastTransitionTime is kept while status is unchanged."""
    previous = {c.get("type"): c for c in (old or []) if isinstance(c, dict)}
    by_type = {c["type"]: c for c in new}
    # Conditions not recomputed this time keep their previous value.
    for t, c in previous.items():
        if t not in by_type and t in CONDITION_TYPES:
            by_type[t] = {k: v for k, v in c.items() if k in ("type", "status", "reason", "message")}
    out = []
    for t in CONDITION_TYPES:
        if t not in by_type:
            continue
        c = dict(by_type[t])
        prev = previous.get(t)
        if prev and prev.get("status") == c["status"] and prev.get("lastTransitionTime"):
            c["lastTransitionTime"] = prev["lastTransitionTime"]
        else:
            c["lastTransitionTime"] = now
        if generation is not None:
            c["observedGeneration"] = generation
        out.append(c)
    return out


def get_condition(conditions: list[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    for c in conditions or []:
        if c.get("type") == type_:
            return c
    return None


def deployment_replicas(dep: dict[str, Any] | None) -> tuple[int, int, int]:
    """(spec.replicas, status.replicas, status.readyReplicas) of a Deployment, zeros when absent."""
    if not dep:
        return 0, 0, 0
    spec = dep.get("spec") or {}
    st = dep.get("status") or {}
    return int(spec.get("replicas") or 0), int(st.get("replicas") or 0), int(st.get("readyReplicas") or 0)


def rollout_state(dep: dict[str, Any] | None) -> tuple[bool, bool, str]:
    """(in_progress, failed, message) for a Deployment."""
    if not dep:
        return True, False, "not created yet"
    meta = dep.get("metadata") or {}
    spec = dep.get("spec") or {}
    st = dep.get("status") or {}
    want = int(spec.get("replicas") or 0)
    for c in st.get("conditions") or []:
        if c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded":
            return True, True, c.get("message") or "progress deadline exceeded"
    if meta.get("generation") is not None and st.get("observedGeneration") is not None \
            and st["observedGeneration"] < meta["generation"]:
        return True, False, "deployment controller has not observed the latest spec"
    updated = int(st.get("updatedReplicas") or 0)
    ready = int(st.get("readyReplicas") or 0)
    total = int(st.get("replicas") or 0)
    if updated < want or ready < want or total > want:
        return True, False, f"{ready}/{want} ready, {updated} updated"
    return False, False, f"{ready}/{want} ready"


def pool_status(dep: dict[str, Any] | None, desired: int) -> dict[str, int]:
    _, replicas, ready = deployment_replicas(dep)
    return {"replicas": replicas, "readyReplicas": ready, "desiredReplicas": int(desired)}


def ratio(prefill: int, decode: int) -> float | None:
    if prefill <= 0:
        return None
    return round(decode / prefill, 3)


def workload_conditions(deployments: dict[str, dict[str, Any] | None]) -> list[dict[str, Any]]:
    """Ready / Progressing / Degraded from the three Deployments."""
    progressing = []
    failed = []
    unready = []
    for role, dep in deployments.items():
        in_progress, is_failed, msg = rollout_state(dep)
        want, _, ready = deployment_replicas(dep)
        if is_failed:
            failed.append(f"{role}: {msg}")
        elif in_progress:
            progressing.append(f"{role}: {msg}")
        if dep is None or ready < max(want, 1):
            unready.append(f"{role} {ready}/{want}")
    out = []
    if unready:
        out.append(condition("Ready", False, "PoolsNotReady", "not ready: " + ", ".join(unready)))
    else:
        out.append(condition("Ready", True, "AllPoolsReady", "all pools have their desired replicas ready"))
    if progressing:
        out.append(condition("Progressing", True, "RollingOut", "; ".join(progressing)))
    else:
        out.append(condition("Progressing", False, "Stable", "no rollout in progress"))
    if failed:
        out.append(condition("Degraded", True, "RolloutFailed", "; ".join(failed)))
    else:
        out.append(condition("Degraded", False, "Reconciled", "all children applied"))
    return out
