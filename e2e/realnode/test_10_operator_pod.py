"""Real-node scenario 1: `helm install` of the chart: the operator runs as a real pod from the operator
image, under the chart's ServiceAccount, non-root with a read-only root filesystem, and passes its probes."""

from __future__ import annotations

from typing import Any

from node_e2e import NODE_NAME, dump, ready
from pdc_e2e import Kube, wait_until


def _operator_pods(kube: Kube, op: dict[str, Any]) -> list[dict[str, Any]]:
    """The Deployment's pods, once there are as many as it wants and all are Ready (else [])."""
    want = kube.json("get", "deployment", op["deployment"], "-n", op["namespace"])["spec"]["replicas"]
    items = [p for p in kube.json("get", "pods", "-n", op["namespace"], "-l", op["selector"])["items"]
             if not p["metadata"].get("deletionTimestamp")]
    return items if len(items) == want and all(ready(p) for p in items) else []


def _without_kopf_cancel_race(log: str) -> str:
    """The log less kopf's own cancel-callback failure (kopf 1.45.2, `_cogs/clients/api.py`
    `request_cancel_callback`: `asyncio.current_task()` is None in a future's done-callback). It is logged by
    asyncio when peering pauses a replica while its first watch request waits for headers: both replicas
    start in the same second and one yields to the other. Nothing of ours runs in it and the paused replica
    resumes as usual; any other traceback still fails the test."""
    records, out = log.splitlines(keepends=True), []
    skipping = False
    for line in records:
        if line[:4].isdigit():  # a new record: "2026-12-07 04:46:17,929 LEVEL logger: ..."
            skipping = "request_cancel_callback" in line
        if not skipping:
            out.append(line)
    return "".join(out)


def test_operator_pod_runs_on_the_real_node(kube: Kube, real_operator: dict[str, Any]):
    pods = wait_until("the operator pods Ready", lambda: _operator_pods(kube, real_operator), timeout=180)
    pod = pods[0]
    ns, name = real_operator["namespace"], pod["metadata"]["name"]
    try:
        assert all(p["spec"]["nodeName"] == NODE_NAME for p in pods)
        (cs,) = pod["status"]["containerStatuses"]
        assert cs["ready"] and cs["state"].get("running"), cs
        assert cs["image"].endswith("pdcluster/operator:0.1.0"), cs["image"]
        sa = pod["spec"]["serviceAccountName"]
        assert sa != "default"
        # what the kubelet actually started: uid, read-only root, the ServiceAccount token mounted
        uid = kube.run("exec", "-n", ns, name, "--", "python3.11", "-c", "import os; print(os.getuid())").stdout
        assert uid.strip() == "65532", uid
        ro = kube.run("exec", "-n", ns, name, "--", "python3.11", "-c",
                      "import os\ntry:\n open('/opt/x','w')\nexcept OSError as e:\n print(e.errno)",
                      check=False).stdout
        assert ro.strip() == "30", f"root filesystem is writable (or other error): {ro!r}"  # EROFS
        tok = kube.run("exec", "-n", ns, name, "--", "python3.11", "-c",
                       "print(len(open('/var/run/secrets/kubernetes.io/serviceaccount/token').read()))").stdout
        assert int(tok) > 100
        # probes pass and keep passing: Ready, never restarted
        again = _operator_pods(kube, real_operator)
        assert again and all(p["status"]["containerStatuses"][0]["restartCount"] == 0 for p in again), again
        # the operator talks to the API server from inside the pod (the `kubernetes` Service)
        log = kube.run("logs", "-n", ns, name, "--tail=200").stdout
        assert "Traceback" not in _without_kopf_cancel_race(log), log[-3000:]
    except AssertionError:
        print(dump(kube, ns))
        raise
