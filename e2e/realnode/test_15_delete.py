"""Real-node scenario 6: `kubectl delete pdc`: every child is garbage-collected, the pods stop, and no
container of the namespace is left in the node's containerd."""

from __future__ import annotations

from node_e2e import ctr, dump
from pdc_e2e import Kube, wait_until


def test_delete_leaves_nothing_on_the_node(kube: Kube, app_ns: str, example_name: str):
    kube.run("delete", "pdc", example_name, "-n", app_ns, "--wait=true", "--timeout=120s")
    try:
        wait_until("children garbage-collected", lambda: not kube.json(
            "get", "deploy,svc,cm,pods", "-n", app_ns, "-l", f"app.kubernetes.io/instance={example_name}"
        )["items"], timeout=180, interval=2)
        flt = f'labels."io.kubernetes.pod.namespace"=={app_ns}'
        wait_until("no container of the namespace in containerd",
                   lambda: ctr("containers", "ls", "-q", flt).stdout.strip() == "", timeout=120, interval=2)
    except BaseException:
        print(dump(kube, app_ns))
        raise
