"""Scenario 4: a spec change rolls the right Deployment and nothing else."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pdc_e2e import ROLES, Kube, Operator, apply_pdc, deployments, example_pdc, wait_ready


def _fingerprint(d: dict[str, Any]) -> tuple[int, str, str]:
    return (d["spec"]["replicas"], json.dumps(d["spec"]["template"], sort_keys=True), d["metadata"]["uid"])


CASES = [
    # (id, spec change, roles whose pod template changes, roles whose replica count changes)
    ("decode-batch-size", {"decode": {"maxBatchSize": 7}}, {"decode"}, set()),
    ("prefill-batch-tokens", {"prefill": {"maxBatchTokens": 1536}}, {"prefill"}, set()),
    ("kv-dtype", {"kvCache": {"dtype": "int8"}}, {"prefill", "decode"}, set()),
    ("router-queue", {"router": {"maxQueueDepth": 17}}, {"router"}, set()),
    ("decode-replicas", {"decode": {"replicas": 2}}, set(), {"decode"}),
]


@pytest.mark.parametrize("change,rolled,scaled", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_spec_change_rolls_only_the_right_deployment(kube: Kube, operator: Operator, namespace: str,
                                                     diag: list[str], change: dict, rolled: set, scaled: set):
    diag.append(namespace)
    doc = example_pdc("roll", decode={"minReplicas": 1, "maxReplicas": 4})
    apply_pdc(kube, namespace, doc)
    pdc = wait_ready(kube, namespace, "roll")
    before = {r: _fingerprint(d) for r, d in deployments(kube, namespace, "roll").items()}
    gen_before = {r: d["metadata"]["generation"] for r, d in deployments(kube, namespace, "roll").items()}

    kube.run("patch", "pdc", "roll", "-n", namespace, "--type=merge", "-p", json.dumps({"spec": change}))
    pdc2 = wait_ready(kube, namespace, "roll")
    assert pdc2["metadata"]["generation"] > pdc["metadata"]["generation"]
    after_deps = deployments(kube, namespace, "roll")
    after = {r: _fingerprint(d) for r, d in after_deps.items()}
    for role in ROLES:
        b, a = before[role], after[role]
        assert a[2] == b[2], f"{role} Deployment was replaced, not updated"
        assert (a[1] != b[1]) == (role in rolled), (
            f"{role}: pod template {'changed' if a[1] != b[1] else 'unchanged'} for {change}")
        assert (a[0] != b[0]) == (role in scaled), f"{role}: replicas {b[0]} -> {a[0]} for {change}"
        if role not in rolled and role not in scaled:
            assert after_deps[role]["metadata"]["generation"] == gen_before[role], (
                f"{role} was written although nothing of it changed")
