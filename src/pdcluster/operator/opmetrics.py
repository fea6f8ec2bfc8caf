"""The operator's own Prometheus metrics (served by `pdcluster operator --metrics-port`)."""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdcluster.operator.status import CONDITION_TYPES

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILES = Counter(
    "pdcluster_operator_reconciles_total", "Reconcile passes by trigger and result.",
    ["trigger", "result"], registry=REGISTRY,
)
ERRORS = Counter(
    "pdcluster_operator_errors_total", "Reconcile errors by kind (api, invalid_spec, render, metrics).",
    ["kind"], registry=REGISTRY,
)
DESIRED = Gauge(
    "pdcluster_autoscaler_desired_replicas", "Replicas the operator wants per pool.",
    ["namespace", "pdcluster", "role"], registry=REGISTRY,
)
DECISIONS = Counter(
    "pdcluster_autoscaler_decisions_total", "Autoscaler decisions by reason.",
    ["namespace", "pdcluster", "reason"], registry=REGISTRY,
)
LEARNED_CAPACITY = Gauge(
    "pdcluster_autoscaler_learned_capacity_tokens_per_second",
    "Learned per-instance capacity (prompt tok/s for prefill, output tok/s for decode).",
    ["namespace", "pdcluster", "role"], registry=REGISTRY,
)
SCALING_STEPS = Counter(
    "pdcluster_autoscaler_scaling_steps_total",
    "Pool size changes by cause: formula, burst, tail, slo-guard, flip, bound, stabilization, limit "
    "(operator/autoscaler_explain.py).",
    ["namespace", "pdcluster", "role", "cause"], registry=REGISTRY,
)
SLO_SCALE_UPS = Counter(
    "pdcluster_autoscaler_slo_scale_ups_total",
    "Pools grown by the SLO guard (an observed latency percentile broke spec.autoscaling.slo).",
    ["namespace", "pdcluster", "role"], registry=REGISTRY,
)
CAPACITY_SCALE = Gauge(
    "pdcluster_autoscaler_capacity_scale",
    "SLO correction applied to the per-instance capacity (1 = as configured or learned).",
    ["namespace", "pdcluster", "role"], registry=REGISTRY,
)
DRAINS = Counter(
    "pdcluster_operator_drains_total", "Pods asked to drain before a scale-down, by result.",
    ["result"], registry=REGISTRY,
)
CONDITION = Gauge(
    "pdcluster_operator_condition",
    "Status conditions of each PDCluster: 1 for the current status (True/False/Unknown), 0 for the others.",
    ["pdcluster", "namespace", "condition", "status"], registry=REGISTRY,
)
CONDITION_STATUSES = ("True", "False", "Unknown")


def set_conditions(namespace: str, name: str, conditions: list[dict[str, Any]]) -> None:
    """Export the conditions written to a PDCluster's status (the kube-state-metrics convention)."""
    for c in conditions:
        type_, current = c.get("type"), c.get("status")
        if not type_:
            continue
        for s in CONDITION_STATUSES:
            CONDITION.labels(name, namespace, type_, s).set(1.0 if s == current else 0.0)


def forget_conditions(namespace: str, name: str) -> None:
    """Drop every condition series of a PDCluster (deleted or being deleted)."""
    for type_, s in [(t, s) for t in CONDITION_TYPES for s in CONDITION_STATUSES]:
        with contextlib.suppress(KeyError):
            CONDITION.remove(name, namespace, type_, s)
