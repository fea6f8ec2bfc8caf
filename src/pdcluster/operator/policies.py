"""Pure rendering of the pool-protection objects: a PodDisruptionBudget per pool and the NetworkPolicy
that lets only router->worker HTTP (plus the operator's /drain and Prometheus scrapes) and prefill->decode
KV transfers reach the workers."""

from __future__ import annotations

from typing import Any

from pdcluster.operator.models import KV_TRANSFER_PORT, WORKER_PORT
from pdcluster.operator.naming import (
    CHILD_LABELS,
    INSTANCE_LABEL,
    NAME_LABEL,
    OPERATOR_POD_LABELS,
    ROLE_LABEL,
    WORKER_ROLES,
    Owner,
    child_name,
    instance_labels,
    meta,
    network_policy_name,
    role_labels,
    selector_labels,
)


def render_pdb(owner: Owner, role: str) -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": meta(owner, child_name(owner, role), role_labels(owner, role)),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner, role)}}}


def render_network_policy(owner: Owner, kv_ports: int = 1,
                          worker_rules: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Workers accept HTTP only from this instance's router (and the operator, for /drain, and
    Prometheus in any namespace for /metrics scraping), and KV transfers only from prefill to decode: on
    ``kv_ports`` consecutive ports (a TP worker's rank r listens on KV_TRANSFER_PORT + r). ``worker_rules``
    replaces that KV rule for another engine's transfer (render_vllm.network_policy_rules)."""
    kv_rules = worker_rules if worker_rules is not None else [
        {"from": [{"podSelector": {"matchLabels": selector_labels(owner, "prefill")}}],
         "ports": [{"protocol": "TCP", "port": KV_TRANSFER_PORT,
                    **({"endPort": KV_TRANSFER_PORT + kv_ports - 1} if kv_ports > 1 else {})}]}]
    router_peer = {"podSelector": {"matchLabels": selector_labels(owner, "router")}}
    operator_peer = {"namespaceSelector": {}, "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}}
    prometheus_peer = {"namespaceSelector": {},
                       "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(owner, network_policy_name(owner), instance_labels(owner)),
        "spec": {
            "podSelector": {"matchExpressions": [
                {"key": INSTANCE_LABEL, "operator": "In", "values": [owner.name]},
                {"key": NAME_LABEL, "operator": "In", "values": [CHILD_LABELS[NAME_LABEL]]},
                {"key": ROLE_LABEL, "operator": "In", "values": list(WORKER_ROLES)},
            ]},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [router_peer, operator_peer, prometheus_peer],
                 "ports": [{"protocol": "TCP", "port": WORKER_PORT}]},
                *kv_rules,
            ],
        },
    }
