"""The operator's own Prometheus metrics (served by `pdcluster operator --metrics-port`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

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
DRAINS = Counter(
    "pdcluster_operator_drains_total", "Pods asked to drain before a scale-down, by result.",
    ["result"], registry=REGISTRY,
)
