"""Real-node scenarios 4 and 5, under steady traffic through the router Service (port-forward):
decode scaled 1 -> 2 by editing the spec (the new pod takes traffic), one decode container killed with
`ctr` (not a Kubernetes delete: the kubelet restarts it while the router routes around it), then 2 -> 1
(scale-down drains). No client request may fail."""

from __future__ import annotations

import time
from typing import Any

from node_e2e import (
    Traffic,
    assert_route_to,
    ctr,
    dump,
    http_json,
    http_text,
    metric_sum,
    pods,
    port_forward,
    ready,
)
from pdc_e2e import Kube, wait_until


def _decode_pods(kube: Kube, ns: str, name: str) -> list[dict[str, Any]]:
    return [p for p in pods(kube, ns, f"app.kubernetes.io/instance={name},pdcluster.dev/role=decode")
            if not p["metadata"].get("deletionTimestamp")]


def _requests(pod: dict[str, Any]) -> float:
    ip = pod["status"]["podIP"]
    assert_route_to(ip)
    return metric_sum(http_text(f"http://{ip}:8000/metrics"), "pdcluster_requests_total")


def _scale(kube: Kube, ns: str, name: str, n: int) -> None:
    kube.run("patch", "pdc", name, "-n", ns, "--type=merge", "-p", f'{{"spec":{{"decode":{{"replicas":{n}}}}}}}')


def test_scale_and_kill_under_traffic(kube: Kube, app_ns: str, example_name: str):
    name = example_name
    try:
        with port_forward(kube, app_ns, f"svc/{name}-router", 8000) as port:
            model = str(http_json(f"http://127.0.0.1:{port}/v1/models")["data"][0]["id"])
            with Traffic(port, model) as traffic:
                (old,) = _decode_pods(kube, app_ns, name)
                t0 = time.monotonic()
                _scale(kube, app_ns, name, 2)
                two = wait_until("2 decode pods Ready", lambda: (ps := _decode_pods(kube, app_ns, name))
                                 and len(ps) == 2 and all(ready(p) for p in ps) and ps, timeout=300, interval=2)
                (new,) = [p for p in two if p["metadata"]["uid"] != old["metadata"]["uid"]]
                print(f"\nscale 1->2: new decode pod Ready after {time.monotonic() - t0:.0f}s")
                wait_until("the new decode pod to take traffic", lambda: _requests(new) > 0, timeout=120)

                # kill the old pod's worker container from the runtime: the kubelet restarts it
                cid = old["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]
                restarts = old["status"]["containerStatuses"][0]["restartCount"]
                cp = ctr("tasks", "kill", "-s", "SIGKILL", cid)
                assert cp.returncode == 0, cp.stderr
                wait_until("the killed container restarted and Ready", lambda: (
                    (p := kube.json("get", "pod", old["metadata"]["name"], "-n", app_ns))
                    and p["status"]["containerStatuses"][0]["restartCount"] > restarts and ready(p)),
                    timeout=300, interval=2)
                ok_before_down = traffic.ok

                t1 = time.monotonic()
                _scale(kube, app_ns, name, 1)
                wait_until("1 decode pod left", lambda: len(kube.json("get", "pods", "-n", app_ns, "-l",
                           f"app.kubernetes.io/instance={name},pdcluster.dev/role=decode")["items"]) == 1,
                           timeout=180, interval=2)
                print(f"scale 2->1: done after {time.monotonic() - t1:.0f}s")
                wait_until("traffic after the scale-down", lambda: traffic.ok > ok_before_down + 2, timeout=120)
        print(f"traffic: {traffic.ok} completions, {len(traffic.failures)} failures")
        assert traffic.ok > 10
        assert not traffic.failures, traffic.failures[:10]
    except BaseException:
        print(dump(kube, app_ns))
        raise
