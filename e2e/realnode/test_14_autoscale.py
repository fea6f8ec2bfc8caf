"""Real-node scenario 4b: the operator's autoscaler (in the chart's operator pod) fed by a real Prometheus
scraping the worker and router pods on the node's bridge (discovered from the API server by the test and
labelled like the chart's PodMonitor relabelling: Debian's Prometheus has no kubernetes_sd). Under load
decode grows; when the load drops to a trickle it shrinks again (the scale-down drains the pod), and no client request fails. The replica timeline is
printed and saved (docs/e2e.md records one)."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from node_e2e import NODE_NAME, Traffic, assert_route_to, dump, free_port, http_json, pods, port_forward
from pdc_e2e import ARTIFACTS, Kube, deployments, wait_until

from pdcluster.operator.autoscaler_explain import CAUSES

INTERVAL, WINDOW, STABILIZATION = 5, 20, 30
MAX_DECODE = 2  # the node has 2 CPUs: a third 500m decode pod stays Pending (Insufficient cpu)


def _prometheus_config(targets_file: Path) -> dict[str, Any]:
    """Debian's Prometheus is built without kubernetes_sd, so the pods are discovered here (`_discover`)
    into a file_sd file carrying the labels the chart's PodMonitor relabelling gives them."""
    return {
        "global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
        "scrape_configs": [{"job_name": "pdcluster-workloads", "honor_labels": True,
                            "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "2s"}]}],
    }


def _discover(kube: Kube, ns: str, out: Path) -> None:
    """What the PodMonitor selects (name=pdcluster, managed-by=pdcluster-operator, port `http`), with
    `pdcluster` from app.kubernetes.io/instance and `role` from pdcluster.dev/role; pods on the bridge only."""
    groups = []
    for p in pods(kube, ns, "app.kubernetes.io/name=pdcluster,app.kubernetes.io/managed-by=pdcluster-operator"):
        ip, labels = (p.get("status") or {}).get("podIP"), p["metadata"]["labels"]
        port = next((c["containerPort"] for c in p["spec"]["containers"][0].get("ports", []) if c.get("name") == "http"),
                    None)
        if not ip or port is None or p["metadata"].get("deletionTimestamp"):
            continue
        assert_route_to(ip)  # the hard network rule, before Prometheus is told to scrape the address
        groups.append({"targets": [f"{ip}:{port}"], "labels": {
            "pdcluster": labels["app.kubernetes.io/instance"], "role": labels["pdcluster.dev/role"],
            "pod": p["metadata"]["name"]}})
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups))
    tmp.replace(out)


@pytest.fixture(scope="module")
def prometheus(kube: Kube, app_ns: str, real_node: str) -> Iterator[str]:
    """Prometheus on this machine, listening on the node's bridge address (the operator pod queries it)."""
    node = kube.json("get", "node", NODE_NAME)
    node_ip = next(a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP")
    work = ARTIFACTS / "realnode-prometheus"
    subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True)
    targets = work / "targets.json"
    _discover(kube, app_ns, targets)
    (work / "prometheus.yml").write_text(json.dumps(_prometheus_config(targets)))  # JSON is YAML
    stop = threading.Event()

    def rediscover() -> None:
        while not stop.wait(2):
            try:
                _discover(kube, app_ns, targets)
            except Exception as e:  # noqa: BLE001 - a failed listing keeps the last file
                print(f"discovery: {e}")
    threading.Thread(target=rediscover, daemon=True).start()
    port = free_port()
    url = f"http://{node_ip}:{port}"
    log = open(work / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(["prometheus", f"--config.file={work / 'prometheus.yml'}",
                             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address={node_ip}:{port}"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until("Prometheus ready", lambda: proc.poll() is None
                   and httpx.get(f"{url}/-/ready", timeout=2).status_code == 200, timeout=60)
        yield url
    finally:
        stop.set()
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def _query(url: str, q: str) -> list[dict[str, Any]]:
    return list(httpx.get(f"{url}/api/v1/query", params={"query": q}, timeout=5).json()["data"]["result"])


def _prometheus_view(url: str, name: str) -> str:
    """Per-pod series the scenario depends on, as Prometheus has them now (for a failure's report)."""
    sel = f'pdcluster="{name}"'
    lines = []
    for q in (f"up{{{sel}}}", f"increase(pdcluster_requests_total{{{sel}}}[1m])",
              f"rate(pdcluster_generation_tokens_total{{{sel}}}[20s])", f"pdcluster_requests_waiting{{{sel}}}"):
        try:
            rows = [f"{r['metric'].get('role')}/{r['metric'].get('pod')}"
                    + "".join(f" {k}={v}" for k, v in sorted(r["metric"].items())
                              if k not in ("__name__", "role", "pod", "pdcluster", "instance", "job"))
                    + f" = {r['value'][1]}" for r in _query(url, q)]
        except Exception as e:  # noqa: BLE001 - a report, not a check
            rows = [f"query failed: {e!r}"]
        lines.append(f"{q}:\n  " + "\n  ".join(rows or ["(no series)"]))
    return "\n".join(lines)


def _describe(kube: Kube, ns: str, name: str) -> list[str]:
    return kube.run("describe", "pdc", name, "-n", ns).stdout.splitlines()


def _scaled_steps(kube: Kube, ns: str, name: str) -> dict[str, list[tuple[int, int, str]]]:
    """Every pool step of the `Scaled` Events `kubectl describe pdc` shows: role -> [(from, to, cause)]
    (`prefill 1->1 (bound), decode 1->2 (formula) (ScaleUp: rate ...)`, operator/scaling.py)."""
    steps: dict[str, list[tuple[int, int, str]]] = {"prefill": [], "decode": []}
    for line in _describe(kube, ns, name):
        if re.search(r"\bScaled\b", line):
            for role, frm, to, cause in re.findall(r"(prefill|decode) (\d+)->(\d+) \(([a-z-]+)\)", line):
                steps[role].append((int(frm), int(to), cause))
    return steps


def _replicas(kube: Kube, ns: str, name: str) -> tuple[int, int]:
    d = deployments(kube, ns, name)["decode"]
    return int(d["spec"]["replicas"]), int((d.get("status") or {}).get("readyReplicas") or 0)


def test_autoscaler_fed_by_prometheus_follows_the_load(kube: Kube, app_ns: str, example_name: str,
                                                        prometheus: str, real_operator: dict[str, Any]):
    name = example_name
    timeline: list[tuple[float, str, int, int]] = []
    t0 = time.monotonic()

    def sample(phase: str) -> tuple[int, int]:
        want, ready_n = _replicas(kube, app_ns, name)
        if not timeline or timeline[-1][1:] != (phase, want, ready_n):
            timeline.append((round(time.monotonic() - t0, 1), phase, want, ready_n))
        return want, ready_n

    load: list[Traffic] = []
    trickle: Traffic | None = None
    try:
        sel = f'pdcluster="{name}"'
        wait_until("Prometheus scraping the router, prefill and decode pods", lambda: {
            r["metric"].get("role") for r in _query(prometheus, f"up{{{sel}}} == 1")} >= {"router", "prefill", "decode"},
            timeout=60, interval=2)
        # decode sized from the metrics (a tiny declared capacity, so a CPU-sized load is "high");
        # prefill pinned to one pod (min = max) so the node's CPUs go to decode
        kube.run("patch", "pdc", name, "-n", app_ns, "--type=merge", "-p", json.dumps({"spec": {
            "prefill": {"replicas": None, "minReplicas": 1, "maxReplicas": 1},
            "decode": {"replicas": None, "minReplicas": 1, "maxReplicas": MAX_DECODE},
            "autoscaling": {"enabled": True, "prometheusUrl": prometheus, "intervalSeconds": INTERVAL,
                            "windowSeconds": WINDOW, "scaleDownStabilizationSeconds": STABILIZATION,
                            "maxScaleDownStep": 1, "headroom": 1.5,
                            "capacity": {"prefillTokensPerSecond": 100000, "decodeTokensPerSecond": 2}}}}))
        wait_until("a first autoscaler decision with metrics", lambda: (
            ((kube.get("pdc", name, app_ns) or {}).get("status") or {}).get("autoscaler") or {}).get("reason"),
            timeout=90, interval=2)
        with port_forward(kube, app_ns, f"svc/{name}-router", 8000) as port:
            model = str(http_json(f"http://127.0.0.1:{port}/v1/models")["data"][0]["id"])
            trickle = Traffic(port, model, pause=6.0)
            with trickle:
                load = [Traffic(port, model) for _ in range(3)]
                for c in load:
                    c.__enter__()
                try:
                    wait_until("decode scaled up by the autoscaler", lambda: sample("load")[0] > 1,
                               timeout=180, interval=2)
                    wait_until("the added decode pods Ready", lambda: (r := sample("load"))[1] == r[0] > 1,
                               timeout=300, interval=2)
                    peak = sample("load")[0]
                    # the decision is explained where a user looks: a Scaled Event with each pool's cause
                    up = _scaled_steps(kube, app_ns, name)
                    assert any(to > frm for frm, to, _ in up["decode"]), up
                    assert all(cause in CAUSES for steps in up.values() for _, _, cause in steps), up
                    # each Ready decode pod took requests (Prometheus' view of the pods' own counters)
                    # (distinct pods: a pod exports several requests_total series, one per outcome)
                    wait_until("every decode pod served requests", lambda: len({
                        r["metric"].get("pod") for r in _query(
                            prometheus, f'increase(pdcluster_requests_total{{{sel},role="decode"}}[1m]) > 0')
                    }) >= peak, timeout=120, interval=2)
                finally:
                    for c in load:
                        c.__exit__(None, None, None)
                t_low = time.monotonic()
                wait_until("decode back to 1 after the load", lambda: sample("trickle") == (1, 1),
                           timeout=WINDOW + STABILIZATION + MAX_DECODE * 40 + 120, interval=2)
                down_s = time.monotonic() - t_low
                described = _scaled_steps(kube, app_ns, name)
                assert any(to < frm for frm, to, _ in described["decode"]), described  # the step down, explained
                drained = [ln for ln in _describe(kube, app_ns, name) if "Drained" in ln and "decode pod " in ln]
                assert drained, "no Drained Event for the decode pod removed"  # drained before it was removed
                time.sleep(2 * INTERVAL)  # a few more trickle requests on the one pod left
        status = kube.get("pdc", name, app_ns)["status"]
        failures = [f for c in (*load, trickle) for f in c.failures]
        ok = sum(c.ok for c in (*load, trickle))
        lines = [f"t={t:6.1f}s {phase:8s} decode desired {w} ready {r}" for t, phase, w, r in timeline]
        report = "\n".join(lines) + f"\ncompletions {ok}, failures {len(failures)}; peak decode {peak}; " \
            f"back to 1 {down_s:.0f}s after the load stopped\nautoscaler: {json.dumps(status.get('autoscaler'))}"
        print("\n" + report)
        (ARTIFACTS / "realnode-autoscale-timeline.txt").write_text(report + "\n")
        assert peak > 1
        assert not failures, failures[:10]
        assert ok > 10
    except BaseException:
        # what a failed run needs to be read afterwards: the replica timeline, the clients' counts and what
        # Prometheus and the autoscaler saw at the end (the CI log keeps only part of the pod dump)
        clients = [(c.ok, len(c.failures), c.failures[-3:]) for c in (*load, *([trickle] if trickle else []))]
        print("\ntimeline: " + "; ".join(f"t={t}s {ph} decode {w}/{r}" for t, ph, w, r in timeline))
        print(f"clients (ok, failures, last failures): {clients}")
        print(_prometheus_view(prometheus, name))
        print("autoscaler: " + json.dumps(((kube.get("pdc", name, app_ns) or {}).get("status") or {}).get("autoscaler")))
        print(dump(kube, app_ns))
        raise
    finally:  # leave the example as test_15 expects it: autoscaling off
        kube.run("patch", "pdc", name, "-n", app_ns, "--type=merge", "-p",
                 '{"spec":{"autoscaling":{"enabled":false}}}', check=False)

