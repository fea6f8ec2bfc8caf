"""The kopf handlers end to end against kmock (the kopf author's Kubernetes API emulator), with the operator
running in `kopf.testing.KopfRunner` exactly as `kopf run -m pdcluster.operator.handlers` would."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

from .conftest import make_body, make_spec
from .kmock_harness import (  # noqa: F401  (operator_stays_within_rbac: an autouse fixture)
    NS,
    PDC,
    _applies,
    _cond,
    _events,
    _http,
    _obj,
    _status,
    operator,
    operator_stays_within_rbac,
    wait_for,
)


async def test_create_applies_children_and_writes_status(k8s: Any, kubeconfig: Any) -> None:
    k8s.objects[PDC, NS, "demo"] = make_body()
    async with operator():
        await wait_for(lambda: _status(k8s).get("endpoint"), what="status.endpoint")
    # Every child, applied with server-side apply under the fixed field manager, force=true.
    for res, name in [
        ("apps/v1/deployments", "demo-prefill"), ("apps/v1/deployments", "demo-decode"),
        ("apps/v1/deployments", "demo-router"), ("v1/services", "demo-prefill"), ("v1/services", "demo-decode"),
        ("v1/services", "demo-router"), ("v1/configmaps", "demo-config"), ("v1/secrets", "demo-kv-secret"),
        ("policy/v1/poddisruptionbudgets", "demo-prefill"), ("networking.k8s.io/v1/networkpolicies", "demo-workers"),
    ]:
        obj = _obj(k8s, res, name)
        assert obj is not None, f"{res} {name} missing"
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"
    applies = _applies(k8s)
    assert applies and all(r.params.get("fieldManager") == "pdcluster-operator" and r.params.get("force") == "true"
                           for r in applies)
    assert _obj(k8s, "apps/v1/deployments", "demo-prefill")["spec"]["replicas"] == 1
    assert _obj(k8s, "apps/v1/deployments", "demo-decode")["spec"]["replicas"] == 2
    st = _status(k8s)
    assert st["observedGeneration"] == 1
    assert st["endpoint"] == "http://demo-router.ns1.svc:8000"
    assert st["prefill"] == {"replicas": 0, "readyReplicas": 0, "desiredReplicas": 1, "tensorParallelSize": 1, "gpus": 0,
                             "flippedReplicas": 0}
    assert st["decode"]["desiredReplicas"] == 2 and st["ratio"] == 2.0
    assert {c["type"] for c in st["conditions"]} == {"Ready", "Progressing", "Degraded", "MetricsAvailable",
                                                     "ScalingLimited", "SLOMet", "KVTransferDegraded", "RoleFlips"}
    assert _cond(st, "Ready")["status"] == "False"
    assert _cond(st, "Degraded")["status"] == "False"
    # The status went through the status subresource.
    assert any(r.method == "PATCH" and r.url.path.endswith("/pdclusters/demo/status") for r in list(k8s))


async def test_drift_is_corrected_and_secret_kept(k8s: Any, kubeconfig: Any) -> None:
    k8s.objects[PDC, NS, "demo"] = make_body()
    async with operator():
        await wait_for(lambda: _status(k8s).get("endpoint"), what="first reconcile")
        key_before = _obj(k8s, "v1/secrets", "demo-kv-secret")["data"]["key"]
        assert len(base64.b64decode(key_before)) >= 32
        # A hand-edit (someone scales the Deployment) and a deletion of a child...
        assert await _http(k8s, "PATCH", "/apis/apps/v1/namespaces/ns1/deployments/demo-decode",
                           {"spec": {"replicas": 7}}) == 200
        assert await _http(k8s, "DELETE", "/apis/apps/v1/namespaces/ns1/deployments/demo-prefill") == 200
        assert await _http(k8s, "DELETE", "/api/v1/namespaces/ns1/services/demo-router") == 200
        # ...are restored by the watch on owned children (no waiting for the periodic resync).
        await wait_for(lambda: _obj(k8s, "apps/v1/deployments", "demo-prefill"), what="prefill restored")
        await wait_for(lambda: (_obj(k8s, "apps/v1/deployments", "demo-decode") or {})
                       .get("spec", {}).get("replicas") == 2, what="decode replicas restored")
        await wait_for(lambda: _obj(k8s, "v1/services", "demo-router"), what="router service restored")
    # The HMAC key was generated once and never rotated by reconciles.
    assert _obj(k8s, "v1/secrets", "demo-kv-secret")["data"]["key"] == key_before
    creates = [r for r in list(k8s) if r.method == "POST" and r.url.path.endswith("/secrets")]
    assert len(creates) == 1


async def test_update_scales_down_gracefully(k8s: Any, kubeconfig: Any) -> None:
    k8s.objects[PDC, NS, "demo"] = make_body()
    for i, created in enumerate(["2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z"]):
        k8s.objects["v1/pods", NS, f"demo-decode-{i}"] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"demo-decode-{i}", "namespace": NS, "creationTimestamp": created,
                         "labels": {"app.kubernetes.io/instance": "demo", "app.kubernetes.io/name": "pdcluster",
                                    "pdcluster.dev/role": "decode"}},
            "spec": {"nodeName": "node-a"},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        }
    async with operator():
        await wait_for(lambda: _status(k8s).get("decode", {}).get("desiredReplicas") == 2, what="first reconcile")
        spec = make_spec()
        spec["decode"]["replicas"] = 1
        assert await _http(k8s, "PATCH", "/apis/pdcluster.dev/v1alpha1/namespaces/ns1/pdclusters/demo",
                           {"metadata": {"generation": 2}, "spec": spec}) == 200
        await wait_for(lambda: _obj(k8s, "apps/v1/deployments", "demo-decode")["spec"]["replicas"] == 1,
                       what="decode scaled to 1")
        await wait_for(lambda: _status(k8s).get("observedGeneration") == 2, what="observedGeneration 2")
    # The youngest ready pod was chosen, marked for the ReplicaSet, and asked to drain first.
    victim = _obj(k8s, "v1/pods", "demo-decode-1")["metadata"].get("annotations") or {}
    keeper = _obj(k8s, "v1/pods", "demo-decode-0")["metadata"].get("annotations") or {}
    assert victim.get("controller.kubernetes.io/pod-deletion-cost") == "-1000"
    assert "pdcluster.dev/draining" in victim
    assert "controller.kubernetes.io/pod-deletion-cost" not in keeper
    assert _status(k8s)["decode"]["desiredReplicas"] == 1


async def test_resume_reapplies_on_operator_restart(k8s: Any, kubeconfig: Any) -> None:
    import json

    spec = make_spec()
    body = make_body(spec=spec, status={"observedGeneration": 1})
    # Already handled by a previous operator process: kopf calls on.resume, not on.create.
    body["metadata"]["annotations"] = {
        "pdcluster.dev/last-handled-configuration": json.dumps({"spec": spec}) + "\n"}
    k8s.objects[PDC, NS, "demo"] = body
    async with operator():
        await wait_for(lambda: _obj(k8s, "apps/v1/deployments", "demo-router"), what="children applied on resume")
        await wait_for(lambda: _status(k8s).get("endpoint"), what="status written on resume")


async def test_invalid_spec_is_degraded_not_a_crash_loop(k8s: Any, kubeconfig: Any) -> None:
    # Structurally fine, but maxTotalReplicas < prefill.min + decode.min (a CEL rule an old API server
    # might not enforce) and an unsupported model URI.
    spec = make_spec(autoscaling={"maxTotalReplicas": 2})
    spec["prefill"].update(minReplicas=2, replicas=2)
    spec["decode"].update(minReplicas=2, replicas=2)
    k8s.objects[PDC, NS, "bad"] = make_body(name="bad", spec=spec)
    async with operator() as runner:
        await wait_for(lambda: _cond(_status(k8s, "bad"), "Degraded"), what="Degraded condition")
        await wait_for(lambda: _events(k8s, "InvalidSpec"), what="InvalidSpec event")
    st = _status(k8s, "bad")
    deg = _cond(st, "Degraded")
    assert deg["status"] == "True" and deg["reason"] == "InvalidSpec"
    assert "maxTotalReplicas" in deg["message"]
    assert _cond(st, "Ready")["status"] == "False"
    assert _obj(k8s, "apps/v1/deployments", "bad-prefill") is None
    assert runner.exception is None and runner.exit_code == 0


async def test_api_errors_back_off_and_retry(k8s: Any, kubeconfig: Any) -> None:
    def deployment_apply(r: Any) -> bool:
        return r.method == "PATCH" and "/deployments/" in r.url.path

    k8s.failures = [(deployment_apply, 500), (deployment_apply, 503)]
    k8s.objects[PDC, NS, "demo"] = make_body()
    async with operator() as runner:
        await wait_for(lambda: _obj(k8s, "apps/v1/deployments", "demo-router"), what="deployments after retries")
        await wait_for(lambda: _status(k8s).get("endpoint"), what="status after retries")
    assert runner.output.count("Kubernetes API error, will retry") >= 2, runner.output[-3000:]
    assert k8s.failures == []  # both injected failures were hit, then the handler retried and succeeded


async def test_autoscaler_holds_when_prometheus_is_unreachable(k8s: Any, kubeconfig: Any) -> None:
    spec = make_spec(autoscaling={"enabled": True, "prometheusUrl": "http://127.0.0.1:9/",
                                  "capacity": {"prefillTokensPerSecond": 10000, "decodeTokensPerSecond": 2000}})
    k8s.objects[PDC, NS, "demo"] = make_body(spec=spec)
    async with operator():
        await wait_for(lambda: _cond(_status(k8s), "MetricsAvailable"), what="MetricsAvailable")
        await wait_for(lambda: _events(k8s, "MetricsUnavailable"), what="MetricsUnavailable event")
    st = _status(k8s)
    m = _cond(st, "MetricsAvailable")
    assert m["status"] == "False" and m["reason"] == "PrometheusUnreachable"
    assert st["autoscaler"]["lastDecision"]["reason"] == "MetricsUnavailable"
    # Held at the spec's starting replicas.
    assert _obj(k8s, "apps/v1/deployments", "demo-prefill")["spec"]["replicas"] == 1
    assert _obj(k8s, "apps/v1/deployments", "demo-decode")["spec"]["replicas"] == 2


async def test_pdcluster_operator_command_runs_the_handlers(k8s: Any, kubeconfig: Any, tmp_path: Path) -> None:
    """`pdcluster operator` as its own process (as the e2e suite and the chart run it) against kmock."""
    import os
    import signal
    import subprocess
    import sys

    import httpx

    from ..netutil import free_port

    k8s.objects[PDC, NS, "demo"] = make_body()
    metrics_port, live_port = free_port(), free_port()
    log = open(tmp_path / "operator.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdcluster", "operator", "--resync-seconds", "5", "--metrics-port", str(metrics_port),
         "--metrics-address", "127.0.0.1", "--liveness", f"http://127.0.0.1:{live_port}/healthz"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "KUBECONFIG": str(kubeconfig)})
    try:
        await wait_for(lambda: proc.poll() is not None or _status(k8s).get("endpoint"), timeout=120,
                       what="status from the operator process")
        assert proc.poll() is None, (tmp_path / "operator.log").read_text()[-3000:]
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
            assert "pdcluster_operator_reconciles_total" in metrics
            assert 'pdcluster_autoscaler_desired_replicas{namespace="ns1",pdcluster="demo",role="decode"} 2.0' \
                in metrics
            assert (await http.get(f"http://127.0.0.1:{live_port}/healthz")).status_code == 200
        # --metrics-address: bound to loopback only, not to every interface.
        assert _listen_addresses(metrics_port) in ({"127.0.0.1"}, None)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, 20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    assert proc.returncode == 0, (tmp_path / "operator.log").read_text()[-3000:]


def _listen_addresses(port: int) -> set[str] | None:
    """Local IPv4 addresses with a listening TCP socket on `port` (from /proc/net/tcp); None off Linux."""
    import socket
    import struct

    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    out = set()
    for line in lines:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if state == "0A" and int(p, 16) == port:
            out.add(socket.inet_ntoa(struct.pack("<I", int(addr, 16))))
    return out
