"""Real-node scenario 2: `kubectl apply -f examples/pdcluster-cpu.yaml` (the file itself, only the namespace
given): prefill, decode and router pods start from the worker image on the real node, pass readiness, and
the PDCluster reports Ready."""

from __future__ import annotations

from typing import Any

from node_e2e import NODE_NAME, dump, pods, ready
from pdc_e2e import EXAMPLE, ROLES, Kube, condition, wait_until


def test_example_becomes_ready_on_the_real_node(kube: Kube, real_operator: dict[str, Any], app_ns: str,
                                                example_name: str):
    kube.run("apply", "-n", app_ns, "-f", str(EXAMPLE))
    try:
        def all_ready() -> list[dict[str, Any]] | None:
            ps = pods(kube, app_ns, f"app.kubernetes.io/instance={example_name}")
            roles = {p["metadata"]["labels"].get("pdcluster.dev/role") for p in ps}
            return ps if roles >= set(ROLES) and all(ready(p) for p in ps) else None

        ps = wait_until("prefill, decode and router pods Ready", all_ready, timeout=420, interval=2)
        for p in ps:
            assert p["spec"]["nodeName"] == NODE_NAME, (p["metadata"]["name"], p["spec"]["nodeName"])
            for cs in p["status"]["containerStatuses"]:
                assert cs["image"].endswith("pdcluster/worker:0.1.0"), cs["image"]
                assert cs["restartCount"] == 0, (p["metadata"]["name"], cs)
            assert p["status"]["podIP"].startswith("10."), p["status"]["podIP"]
        pdc = wait_until("PDCluster Ready", lambda: (d := kube.get("pdc", example_name, app_ns))
                         and (condition(d, "Ready") or {}).get("status") == "True" and d, timeout=120)
        assert pdc["status"].get("observedGeneration") == pdc["metadata"]["generation"]
    except BaseException:
        print(dump(kube, app_ns, real_operator["namespace"]))
        raise
