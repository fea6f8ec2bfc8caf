"""Scenario 1: `kubectl apply -f examples/pdcluster-cpu.yaml` after `helm install`: children appear with
controller owner references, pods go Ready (kwok), status and conditions follow, printer columns show."""

from __future__ import annotations

import yaml
from pdc_e2e import EXAMPLE, ROLES, Kube, Operator, condition, deployments, wait_ready, wait_until


def test_apply_cpu_example(kube: Kube, operator: Operator, namespace: str, diag: list[str]):
    diag.append(namespace)
    name = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
    kube.run("apply", "-n", namespace, "-f", str(EXAMPLE))
    pdc = wait_ready(kube, namespace, name, timeout=120)
    uid = pdc["metadata"]["uid"]

    # children: one Deployment per role, named <name>-<role>, labelled, controller-owned by the PDCluster
    deps = deployments(kube, namespace, name)
    assert set(deps) == set(ROLES)
    for role, d in deps.items():
        assert d["metadata"]["name"] == f"{name}-{role}"
        labels = d["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "pdcluster"
        assert labels["app.kubernetes.io/instance"] == name
        assert labels["pdcluster.dev/role"] == role
        (ref,) = [r for r in d["metadata"]["ownerReferences"] if r.get("controller")]
        assert (ref["kind"], ref["name"], ref["uid"], ref["apiVersion"]) == (
            "PDCluster", name, uid, "pdcluster.dev/v1alpha1")
        assert ref.get("blockOwnerDeletion") is True
    svcs = kube.json("get", "services", "-n", namespace, "-l", f"app.kubernetes.io/instance={name}")["items"]
    assert f"{name}-router" in {s["metadata"]["name"] for s in svcs}
    for obj in svcs:
        assert any(r["uid"] == uid and r.get("controller") for r in obj["metadata"]["ownerReferences"]), obj

    # pods scheduled onto the kwok GPU nodes and Ready
    pods = kube.json("get", "pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={name}")["items"]
    want = sum(d["spec"]["replicas"] for d in deps.values())
    assert len(pods) == want
    for p in pods:
        assert p["spec"].get("nodeName", "").startswith("kwok-gpu-"), p["spec"].get("nodeName")
        ready = [c for c in p["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True"

    # status follows the children
    st = pdc["status"]
    for role in ROLES:
        assert st[role]["replicas"] == deps[role]["spec"]["replicas"], (role, st[role])
        assert st[role]["readyReplicas"] == deps[role]["spec"]["replicas"], (role, st[role])
    assert st.get("endpoint"), st
    assert st["observedGeneration"] == pdc["metadata"]["generation"]
    # role flips are the default and the example's pools are interchangeable (test_09: a case where they are not)
    assert pdc["spec"]["roleFlips"] is True  # the CRD's default, the example sets none
    flips = condition(pdc, "RoleFlips") or {}
    assert (flips.get("status"), flips.get("reason")) == ("True", "PoolsInterchangeable"), flips
    assert flips.get("observedGeneration") == pdc["metadata"]["generation"], flips

    # printer columns
    table = kube.run("get", "pdc", name, "-n", namespace).stdout.splitlines()
    header, row = table[0].split(), table[1].split()
    assert header[:7] == ["NAME", "PREFILL", "DECODE", "RATIO", "READY", "DEGRADED", "AGE"], header
    assert row[0] == name and row[1] == str(st["prefill"]["replicas"]) and row[4] == "True", row
    assert row[5] == "Reconciled", row  # the Degraded reason while healthy

    # events from the operator on the PDCluster
    def events() -> list[dict]:
        return kube.json("get", "events", "-n", namespace, "--field-selector",
                         f"involvedObject.kind=PDCluster,involvedObject.name={name}")["items"]
    wait_until("an Event on the PDCluster", events, timeout=30)
