"""Scenario 7: `kubectl delete pdc` garbage-collects every child (owner references + the real garbage
collector in kube-controller-manager)."""

from __future__ import annotations

import subprocess
import time

from pdc_e2e import KUBECTL, RESYNC_SECONDS, Kube, Operator, apply_pdc, example_pdc, wait_ready, wait_until

CHILD_KINDS = "deployments,replicasets,pods,services,configmaps,secrets,poddisruptionbudgets,networkpolicies"


def test_delete_pdc_garbage_collects_children(kube: Kube, operator: Operator, namespace: str,
                                              diag: list[str]):
    diag.append(namespace)
    apply_pdc(kube, namespace, example_pdc("gc"))
    apply_pdc(kube, namespace, example_pdc("keep"))
    wait_ready(kube, namespace, "gc")
    wait_ready(kube, namespace, "keep")

    def children(name: str) -> list[str]:
        items = kube.json("get", CHILD_KINDS, "-n", namespace, "-l", f"app.kubernetes.io/instance={name}")["items"]
        return [f"{i['kind']}/{i['metadata']['name']}" for i in items]

    before = children("gc")
    assert any(c.startswith("Deployment/") for c in before) and any(c.startswith("Pod/") for c in before)
    # watch the Deployments while the PDCluster goes away: the operator must not re-create any
    uids = {d["metadata"]["uid"] for d in kube.json("get", "deployments", "-n", namespace,
                                                    "-l", "app.kubernetes.io/instance=gc")["items"]}
    watch = subprocess.Popen(
        [str(KUBECTL), "get", "deployments", "-n", namespace, "-l", "app.kubernetes.io/instance=gc", "-w",
         "--output-watch-events", "--no-headers", "-o",
         "custom-columns=E:.type,N:.object.metadata.name,U:.object.metadata.uid"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=kube.env)
    try:
        time.sleep(1.0)
        kube.run("delete", "pdc", "gc", "-n", namespace, "--wait=true", "--timeout=60s")
        wait_until("every child of gc garbage-collected", lambda: children("gc") == [], timeout=90)
        time.sleep(2 * RESYNC_SECONDS)  # a late resync or kick would re-create children now
        wait_until("every child of gc garbage-collected", lambda: children("gc") == [], timeout=90)
    finally:
        watch.terminate()
        out = watch.communicate(timeout=10)[0]
    recreated = [ln for ln in out.splitlines() if ln.split()[:1] == ["ADDED"] and ln.split()[-1] not in uids]
    assert not recreated, (
        "the operator re-created children of a PDCluster that was being deleted (deletionTimestamp set); "
        "the garbage collector then deleted them again:\n" + "\n".join(recreated))
    # unlabelled children (if any) must go too: nothing left that is owned by the deleted PDCluster
    everything = kube.json("get", CHILD_KINDS, "-n", namespace)["items"]
    orphans = [f"{i['kind']}/{i['metadata']['name']}" for i in everything
               if any(r.get("kind") == "PDCluster" and r.get("name") == "gc"
                      for r in i["metadata"].get("ownerReferences", []))]
    assert not orphans, orphans
    # the other PDCluster is untouched
    assert children("keep") and wait_ready(kube, namespace, "keep", timeout=10)
