"""Pure status shaping: conditions (with stable lastTransitionTime), per-pool replicas, ratio, and
`status.autoscaler` (the autoscaler's State and last Decision as the PDCluster records them)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from pdcluster.operator import autoscaler_explain as explain
from pdcluster.operator.autoscaler import Decision, PoolDecision, PoolState, State
from pdcluster.operator.autoscaler_rules import MAX_NEED_SAMPLES

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "MetricsAvailable", "ScalingLimited", "SLOMet",
                   "KVTransferDegraded", "RoleFlips")


def fmt_time(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str) -> float:
    """RFC 3339 -> epoch seconds; ValueError for anything else (status can be hand-edited to any JSON)."""
    if not isinstance(value, str):
        raise ValueError(f"not a timestamp: {value!r}")
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


def pool_status(dep: dict[str, Any] | None, desired: int,
                layout: tuple[int, int] | None = None, flipped: int | None = None) -> dict[str, int]:
    """Replicas of a pool; for a worker pool also its `layout` (TP size, GPUs per pod), the GPUs its
    pods hold (replicas x GPUs per pod: 0 on CPU) and how many of its pods came by a role flip."""
    _, replicas, ready = deployment_replicas(dep)
    out = {"replicas": replicas, "readyReplicas": ready, "desiredReplicas": int(desired)}
    if layout is not None:
        tp, gpus_per_pod = layout
        out.update(tensorParallelSize=int(tp), gpus=replicas * int(gpus_per_pod))
    if flipped is not None:
        out["flippedReplicas"] = int(flipped)
    return out


def ratio(prefill: int, decode: int) -> float | None:
    if prefill <= 0:
        return None
    return round(decode / prefill, 3)


def pdcluster_status(*, generation: int | None, old_conditions: list[dict[str, Any]] | None,
                     conditions: list[dict[str, Any]], deployments: dict[str, dict[str, Any] | None],
                     desired: dict[str, int], router_replicas: int, endpoint: str,
                     autoscaler: dict[str, Any] | None, now: str,
                     layouts: dict[str, tuple[int, int]] | None = None,
                     flipped: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The PDCluster's whole status after a pass (`now` RFC 3339; an empty `autoscaler` is left out;
    `layouts`: (TP size, GPUs per pod) of each worker pool; `flipped`: each worker pool's pods that came
    from the other pool by a role flip)."""
    layouts, flipped = layouts or {}, flipped or {}
    return {
        "observedGeneration": generation,
        "conditions": merge_conditions(old_conditions, conditions, now, generation),
        "prefill": pool_status(deployments["prefill"], desired["prefill"], layouts.get("prefill"),
                               flipped.get("prefill")),
        "decode": pool_status(deployments["decode"], desired["decode"], layouts.get("decode"),
                              flipped.get("decode")),
        "router": pool_status(deployments["router"], router_replicas),
        "ratio": ratio(desired["prefill"], desired["decode"]),
        "endpoint": endpoint,
        "autoscaler": autoscaler or None,
    }


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


# ---- status.autoscaler <-> the autoscaler's State ----------------------------------------------------
# The state lives in the PDCluster's status so that a restarted operator neither forgets learned
# capacities nor restarts a stabilization window.

def autoscaler_state(autoscaler_status: Mapping[str, Any] | None) -> State:
    """Rebuild the autoscaler's State from status.autoscaler; unreadable fields count as absent."""
    sts = autoscaler_status or {}
    learned = sts.get("learnedCapacity") or {}
    stab = sts.get("stabilization") or {}
    last = sts.get("lastScaleTime") or {}
    ready = sts.get("readyTime") or {}  # when each pool's last change was first seen ready
    slo = sts.get("slo") or {}

    def t(v: Any) -> float | None:
        try:
            return parse_time(v) if v else None
        except (TypeError, ValueError):
            return None

    def pool(role: str, cap_key: str) -> PoolState:
        s = stab.get(role) or {}
        g = (slo.get(role) if isinstance(slo, dict) else None) or {}
        cap = learned.get(cap_key)
        tp = learned.get(f"{role}TensorParallelSize")  # the layout it was learned at (absent: TP 1)
        scale = g.get("capacityScale")
        breaches = g.get("breaches")
        return PoolState(
            below_since=t(s.get("belowSince")),
            max_need=float(s["maxNeed"]) if isinstance(s.get("maxNeed"), int | float) else None,
            last_change=t(last.get(role)),
            ready_at=t(ready.get(role)) if isinstance(ready, dict) else None,
            learned_capacity=float(cap) if isinstance(cap, int | float) and cap > 0 else None,
            recent_needs=_needs(s.get("recentNeeds")),
            recent_bursts=_needs(s.get("recentBursts")),
            capacity_scale=float(scale) if isinstance(scale, int | float) and 0 < scale <= 1 else 1.0,
            slo_breaches=breaches if isinstance(breaches, int) and breaches >= 0 else 0,
            tensor_parallel=tp if isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1 else None,
        )

    return State(prefill=pool("prefill", "prefillTokensPerSecond"),
                 decode=pool("decode", "decodeTokensPerSecond"))


def _needs(v: Any) -> tuple[tuple[float, float], ...]:
    """stabilization.<pool>.recentNeeds: [[epoch seconds, need], ...] (bounded; junk entries dropped)."""
    if not isinstance(v, list):
        return ()
    out = []
    for item in v[:MAX_NEED_SAMPLES]:
        if (isinstance(item, list) and len(item) == 2 and all(isinstance(x, int | float) for x in item)
                and item[1] >= 0):
            out.append((float(item[0]), float(item[1])))
    return tuple(out)


def autoscaler_state_status(state: State) -> dict[str, Any]:
    """The State as status.autoscaler fields (learnedCapacity, stabilization, lastScaleTime, slo)."""
    def pool(ps: PoolState) -> dict[str, Any] | None:
        if ps.below_since is None and not ps.recent_needs and not ps.recent_bursts:
            return None
        out: dict[str, Any] = {"maxNeed": ps.max_need,
                               "recentNeeds": [[round(t, 3), round(n, 4)] for t, n in ps.recent_needs],
                               "recentBursts": [[round(t, 3), round(n, 4)] for t, n in ps.recent_bursts]}
        if ps.below_since is not None:
            out["belowSince"] = fmt_time(ps.below_since)
        return out

    def guard(ps: PoolState) -> dict[str, Any]:
        return {"capacityScale": round(ps.capacity_scale, 4), "breaches": ps.slo_breaches}

    return {
        "learnedCapacity": {
            "prefillTokensPerSecond": state.prefill.learned_capacity,
            "decodeTokensPerSecond": state.decode.learned_capacity,
            "prefillTensorParallelSize": state.prefill.tensor_parallel,
            "decodeTensorParallelSize": state.decode.tensor_parallel,
        },
        "stabilization": {"prefill": pool(state.prefill), "decode": pool(state.decode)},
        "slo": {"prefill": guard(state.prefill), "decode": guard(state.decode)},
        "lastScaleTime": {
            "prefill": fmt_time(state.prefill.last_change) if state.prefill.last_change else None,
            "decode": fmt_time(state.decode.last_change) if state.decode.last_change else None,
        },
        "readyTime": {
            "prefill": fmt_time(state.prefill.ready_at) if state.prefill.ready_at else None,
            "decode": fmt_time(state.decode.ready_at) if state.decode.ready_at else None,
        },
    }


def decision_record(d: Decision, now: str) -> dict[str, Any]:
    """status.autoscaler.lastDecision: what was decided and from which inputs."""
    causes = explain.causes(d)

    def pool(p: PoolDecision, role: str) -> dict[str, Any]:
        return {"current": p.current, "recommended": p.recommended, "desired": p.desired, "reason": p.reason,
                "cause": causes[role], "capacitySource": p.capacity_source, "sloBreached": p.slo_breached}

    out = {"time": now, "reason": d.reason, "message": explain.message(d), "prefill": pool(d.prefill, "prefill"),
           "decode": pool(d.decode, "decode"), "limitedBy": list(d.limited_by), "inputs": dict(d.inputs)}
    lo, hi = d.inputs.get("ratioMin"), d.inputs.get("ratioMax")
    if lo is not None or hi is not None:  # spec.autoscaling.ratio, and where the decision stands in it
        out["ratio"] = {"min": lo, "max": hi, "prefillPerDecode": ratio_pd(d.prefill.desired, d.decode.desired),
                        "held": any(x.startswith("ratio-") and x != "ratio-unsatisfiable" for x in d.limited_by),
                        "satisfiable": "ratio-unsatisfiable" not in d.limited_by}
    return out


def ratio_pd(prefill: int, decode: int) -> float | None:
    """Prefill replicas per decode replica (the orientation of spec.autoscaling.ratio)."""
    return round(prefill / decode, 3) if decode > 0 else None


def autoscaler_status(d: Decision, now: str) -> dict[str, Any]:
    """The whole status.autoscaler after an evaluation at `now` (RFC 3339)."""
    return {**autoscaler_state_status(d.state), "lastEvaluationTime": now, "reason": d.reason,
            "lastDecision": decision_record(d, now)}
