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


def _prefill_pods(kube: Kube, ns: str, name: str) -> list[dict[str, Any]]:
    return [p for p in pods(kube, ns, f"app.kubernetes.io/instance={name},pdcluster.dev/role=prefill")
            if not p["metadata"].get("deletionTimestamp")]


def _pod_metric(pod: dict[str, Any], name: str) -> float:
    ip = pod["status"]["podIP"]
    assert_route_to(ip)
    return metric_sum(http_text(f"http://{ip}:8000/metrics"), name)


def test_prefill_scale_in_with_kv_in_flight_loses_nothing(kube: Kube, app_ns: str, example_name: str):
    """Issue 37 item 7 on real pods: prefill 1 -> 2 under three back-to-back clients (long prompts go prefill ->
    KV -> decode), then 2 -> 1. The operator drains the victim with /drain?wait=true before it lowers the
    Deployment: the worker counts a prefill stream as in flight until its KV reached the decode pod, so the
    drain returns (its `Drained` Event, in `kubectl describe pdc`) only when no decode still needs that pod's
    KV. No client request fails and the decode pod counts no failed KV load (nothing was recomputed)."""
    name = example_name
    t_phase = time.monotonic()
    try:
        with port_forward(kube, app_ns, f"svc/{name}-router", 8000) as port:
            model = str(http_json(f"http://127.0.0.1:{port}/v1/models")["data"][0]["id"])
            clients = [Traffic(port, model) for _ in range(3)]
            for c in clients:
                c.__enter__()
            try:
                (old,) = _prefill_pods(kube, app_ns, name)
                (decode,) = _decode_pods(kube, app_ns, name)
                kube.run("patch", "pdc", name, "-n", app_ns, "--type=merge", "-p",
                         '{"spec":{"prefill":{"replicas":2}}}')
                two = wait_until("2 prefill pods Ready", lambda: (ps := _prefill_pods(kube, app_ns, name))
                                 and len(ps) == 2 and all(ready(p) for p in ps) and ps, timeout=300, interval=2)
                (new,) = [p for p in two if p["metadata"]["uid"] != old["metadata"]["uid"]]
                wait_until("the new prefill pod sending KV", lambda: _pod_metric(
                    new, "pdcluster_kv_transfer_bytes_total") > 0, timeout=120)
                failed_loads = _pod_metric(decode, "pdcluster_kv_transfer_failures_total")
                ok_before = sum(c.ok for c in clients)
                t1 = time.monotonic()
                kube.run("patch", "pdc", name, "-n", app_ns, "--type=merge", "-p",
                         '{"spec":{"prefill":{"replicas":1}}}')
                wait_until("1 prefill pod left", lambda: len(kube.json("get", "pods", "-n", app_ns, "-l",
                           f"app.kubernetes.io/instance={name},pdcluster.dev/role=prefill")["items"]) == 1,
                           timeout=240, interval=2)
                print(f"\nprefill 2->1: done after {time.monotonic() - t1:.0f}s")
                wait_until("traffic after the prefill scale-in", lambda: sum(c.ok for c in clients) > ok_before + 6,
                           timeout=120)
                assert _pod_metric(decode, "pdcluster_kv_transfer_failures_total") == failed_loads
                router = http_json(f"http://127.0.0.1:{port}/cluster")["router"]
            finally:
                for c in clients:
                    c.__exit__(None, None, None)
        described = kube.run("describe", "pdc", name, "-n", app_ns).stdout
        victim = [ln.strip() for ln in described.splitlines() if "Drained" in ln and "prefill pod " in ln]
        print(f"{victim}\nrouter: retries {router['retries']}, resumes {router['resumes']}; phase "
              f"{time.monotonic() - t_phase:.0f}s")
        (served,) = [ln for ln in victim if new["metadata"]["name"] in ln]  # the youngest pod went
        assert "drained: idle after" in served, served
        failures = [f for c in clients for f in c.failures]
        assert not failures, failures[:10]
        assert sum(c.ok for c in clients) > 10
    except BaseException:
        print(dump(kube, app_ns))
        raise
