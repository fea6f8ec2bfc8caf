"""Scenario 3: drift. A child scaled, deleted or edited by hand is restored by the operator."""

from __future__ import annotations

from pdc_e2e import Kube, Operator, apply_pdc, deployments, example_pdc, rollout_done, wait_ready, wait_until


def test_hand_scaled_child_is_restored(kube: Kube, operator: Operator, namespace: str, diag: list[str]):
    diag.append(namespace)
    apply_pdc(kube, namespace, example_pdc("drift"))
    wait_ready(kube, namespace, "drift")
    want = deployments(kube, namespace, "drift")["prefill"]["spec"]["replicas"]
    kube.run("scale", "deployment/drift-prefill", "-n", namespace, f"--replicas={want + 3}")
    wait_until(f"drift-prefill back to {want} replicas", lambda: (
        d := deployments(kube, namespace, "drift")["prefill"])["spec"]["replicas"] == want and rollout_done(d),
        timeout=30)


def test_deleted_children_are_recreated(kube: Kube, operator: Operator, namespace: str, diag: list[str]):
    diag.append(namespace)
    apply_pdc(kube, namespace, example_pdc("drift2"))
    pdc = wait_ready(kube, namespace, "drift2")
    old = deployments(kube, namespace, "drift2")["decode"]["metadata"]["uid"]
    svc_old = kube.get("service", "drift2-router", namespace)["metadata"]["uid"]
    kube.run("delete", "deployment/drift2-decode", "service/drift2-router", "-n", namespace, "--wait=true",
             "--timeout=30s")

    def recreated() -> bool:
        d = kube.get("deployment", "drift2-decode", namespace)
        s = kube.get("service", "drift2-router", namespace)
        return bool(d and s and d["metadata"]["uid"] != old and s["metadata"]["uid"] != svc_old)
    wait_until("drift2-decode and drift2-router recreated", recreated, timeout=30)
    d = kube.get("deployment", "drift2-decode", namespace)
    assert any(r["uid"] == pdc["metadata"]["uid"] and r.get("controller") for r in d["metadata"]["ownerReferences"])
    wait_ready(kube, namespace, "drift2")


def test_hand_edited_pod_template_is_reverted(kube: Kube, operator: Operator, namespace: str, diag: list[str]):
    diag.append(namespace)
    apply_pdc(kube, namespace, example_pdc("drift3"))
    wait_ready(kube, namespace, "drift3")
    before = deployments(kube, namespace, "drift3")["router"]["spec"]["template"]["spec"]["containers"][0]
    # a user (client-side kubectl, another field manager) changes the image the operator owns
    kube.run("set", "image", "deployment/drift3-router", "-n", namespace, f"{before['name']}=busybox:hacked")

    def reverted() -> bool:
        c = deployments(kube, namespace, "drift3")["router"]["spec"]["template"]["spec"]["containers"][0]
        return c["image"] == before["image"]
    wait_until("the router image reverted", reverted, timeout=30)
    wait_ready(kube, namespace, "drift3")
