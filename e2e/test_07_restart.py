"""Scenario 6: the operator SIGKILLed mid-reconcile and restarted converges: no duplicate objects, no
flapping afterwards."""

from __future__ import annotations

import signal
import time

from pdc_e2e import RESYNC_SECONDS, ROLES, Kube, Operator, apply_pdc, deployments, example_pdc, wait_ready


def test_sigkill_mid_reconcile_then_restart_converges(kube: Kube, operator: Operator, namespace: str,
                                                      diag: list[str]):
    diag.append(namespace)
    names = [f"crash{i}" for i in range(3)]
    for n in names:
        apply_pdc(kube, namespace, example_pdc(n))
    # mid-reconcile: some children exist, status not yet Ready
    time.sleep(0.7)
    operator.kill(signal.SIGKILL)
    assert not operator.alive()
    # a spec change while the operator is down must be picked up on restart
    kube.run("patch", "pdc", names[0], "-n", namespace, "--type=merge", "-p",
             '{"spec": {"decode": {"maxBatchSize": 5}}}')
    operator.start()

    for n in names:
        wait_ready(kube, namespace, n, timeout=120)
    # no duplicates: exactly one Deployment per role and one router Service per PDCluster
    for n in names:
        deps = deployments(kube, namespace, n)  # asserts one per role
        assert set(deps) == set(ROLES)
        svcs = kube.json("get", "services", "-n", namespace, "-l", f"app.kubernetes.io/instance={n}")["items"]
        assert len({s["metadata"]["name"] for s in svcs}) == len(svcs)
        rs = kube.json("get", "replicasets", "-n", namespace, "-l", f"app.kubernetes.io/instance={n}")["items"]
        live = [r for r in rs if r["spec"].get("replicas", 0) > 0]
        assert len(live) == len(ROLES), [r["metadata"]["name"] for r in live]
    c = deployments(kube, namespace, names[0])["decode"]["spec"]["template"]["spec"]["containers"][0]
    argv = c.get("command", []) + c.get("args", [])
    assert "--max-batch-size" in argv and argv[argv.index("--max-batch-size") + 1] == "5", (
        f"the spec change made while the operator was down was not applied: {argv}")

    # no flapping: across two resync periods nothing of the children changes
    snap = {n: {r: (d["metadata"]["resourceVersion"], d["metadata"]["generation"])
                for r, d in deployments(kube, namespace, n).items()} for n in names}
    pdc_rv = {n: kube.get("pdc", n, namespace)["metadata"]["resourceVersion"] for n in names}
    time.sleep(2 * RESYNC_SECONDS + 1)
    for n in names:
        now = {r: (d["metadata"]["resourceVersion"], d["metadata"]["generation"])
               for r, d in deployments(kube, namespace, n).items()}
        assert now == snap[n], f"{n}: Deployments keep changing with no spec change: {snap[n]} -> {now}"
        assert kube.get("pdc", n, namespace)["metadata"]["resourceVersion"] == pdc_rv[n], (
            f"{n}: the PDCluster (status) keeps being rewritten with nothing changing")
