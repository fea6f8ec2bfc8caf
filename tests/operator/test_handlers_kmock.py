"""The kopf handlers end to end against kmock (the kopf author's Kubernetes API emulator), with the operator
running in `kopf.testing.KopfRunner` exactly as `kopf run -m pdcluster.operator.handlers` would."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml
from kopf.testing import KopfRunner

from pdcluster.operator import handlers

from .conftest import make_body, make_spec

PDC = "pdcluster.dev/v1alpha1/pdclusters"
NS = "ns1"


def _obj(k8s: Any, res: str, name: str, ns: str = NS) -> dict[str, Any] | None:
    key = (kmock.resource(res), ns, name)
    if key not in k8s.objects or k8s.objects[key].deleted:
        return None
    return k8s.objects[key].raw


async def wait_for(pred: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.asynccontextmanager
async def operator(resync: float = 60.0) -> AsyncIterator[KopfRunner]:
    """Run the operator in a thread; exit it from a thread too, so kmock (on this loop) keeps serving."""
    handlers.RUNTIME.resync_seconds = resync
    runner = KopfRunner(["run", "--standalone", "-A", "-m", "pdcluster.operator.handlers"], timeout=30)
    runner.__enter__()
    try:
        yield runner
    finally:
        await asyncio.to_thread(runner.__exit__, None, None, None)
        handlers.RUNTIME.resync_seconds = 60.0


RBAC_RULES = yaml.safe_load((Path(__file__).resolve().parents[2] / "operator" / "rbac.yaml").read_text())["rules"]
VERBS = {"LIST": "list", "WATCH": "watch", "FETCH": "get", "CREATE": "create", "DELETE": "delete"}


def _granted(group: str, resource: str, verb: str) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in RBAC_RULES)


@pytest.fixture(autouse=True)
def operator_stays_within_rbac(k8s: Any) -> Iterator[None]:
    """Every API request the operator (kopf or our client) made in the test is allowed by operator/rbac.yaml."""
    yield
    used = set()
    for r in list(k8s):
        agent = (r.headers or {}).get("User-Agent", "")
        if r.resource is None or not r.resource.plural or \
                not (agent.startswith("kopf/") or agent.startswith("pdcluster-operator")):
            continue
        if r.action is None:
            continue
        name = r.action.name
        verb = VERBS.get(name) or ("patch" if r.method == "PATCH" else "update")
        resource = r.resource.plural + (f"/{r.subresource}" if r.subresource else "")
        used.add((r.resource.group, resource, verb))
        if verb == "patch" and "apply-patch" in (r.headers or {}).get("Content-Type", ""):
            used.add((r.resource.group, resource, "create"))  # apply may create: authorized as create too
    missing = sorted(u for u in used if not _granted(*u))
    assert not missing, f"operator/rbac.yaml does not grant what the operator used: {missing}"


def _status(k8s: Any, name: str = "demo") -> dict[str, Any]:
    return (_obj(k8s, PDC, name) or {}).get("status") or {}


def _cond(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for c in status.get("conditions") or []:
        if c["type"] == type_:
            return c
    return None


def _applies(k8s: Any) -> list[Any]:
    return [r for r in list(k8s) if r.method == "PATCH" and
            "apply-patch" in (r.headers or {}).get("Content-Type", "")]


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
    assert st["prefill"] == {"replicas": 0, "readyReplicas": 0, "desiredReplicas": 1}
    assert st["decode"]["desiredReplicas"] == 2 and st["ratio"] == 2.0
    assert {c["type"] for c in st["conditions"]} == {"Ready", "Progressing", "Degraded", "MetricsAvailable",
                                                     "ScalingLimited", "SLOMet"}
    assert _cond(st, "Ready")["status"] == "False"
    assert _cond(st, "Degraded")["status"] == "False"
    # The status went through the status subresource.
    assert any(r.method == "PATCH" and r.url.path.endswith("/pdclusters/demo/status") for r in list(k8s))


async def _http(k8s: Any, method: str, path: str, body: Any = None,
                content_type: str = "application/merge-patch+json") -> int:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        kw: dict[str, Any] = {}
        if body is not None:
            kw = {"json": body, "headers": {"Content-Type": content_type}}
        async with s.request(method, str(k8s.url).rstrip("/") + path, **kw) as r:
            await r.read()
            return r.status


def _events(k8s: Any, reason: str) -> list[Any]:
    return [r.data for r in list(k8s)
            if r.method == "POST" and r.url.path.endswith("/events") and (r.data or {}).get("reason") == reason]


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
    import socket
    import subprocess
    import sys

    import httpx

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    k8s.objects[PDC, NS, "demo"] = make_body()
    metrics_port, live_port = free_port(), free_port()
    log = open(tmp_path / "operator.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdcluster", "operator", "--resync-seconds", "5", "--metrics-port", str(metrics_port),
         "--metrics-address", "127.0.0.1", "--liveness", f"http://127.0.0.1:{live_port}/healthz"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "KUBECONFIG": str(kubeconfig)})
    try:
        await wait_for(lambda: proc.poll() is not None or _status(k8s).get("endpoint"), timeout=30,
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


# ---- deletion, namespace termination, no finalizer (findings of the e2e suite on a real API server) ------

def _finalizers_added(k8s: Any) -> list[Any]:
    """Requests by which anyone (kopf included) put a finalizer on a PDCluster."""
    def adds(data: Any) -> bool:
        if isinstance(data, list):  # a JSON patch (kopf's way of adding and removing its finalizer)
            return any(op.get("op") in ("add", "replace") and str(op.get("path", "")).startswith("/metadata/finalizers")
                       for op in data if isinstance(op, dict))
        return bool(((data or {}).get("metadata") or {}).get("finalizers"))

    return [r for r in list(k8s) if r.method in ("PATCH", "PUT") and "/pdclusters/" in r.url.path and adds(r.data)]


async def test_no_finalizer_and_the_legacy_one_is_removed(k8s: Any, kubeconfig: Any) -> None:
    """kopf adds a finalizer for daemons; the operator has none, so an uninstalled operator cannot leave
    PDClusters Terminating. Objects of older versions lose `pdcluster.dev/finalizer` when seen."""
    k8s.objects[PDC, NS, "demo"] = make_body()
    old = make_body(name="old")
    old["metadata"]["finalizers"] = [handlers.LEGACY_FINALIZER, "example.com/keep"]
    k8s.objects[PDC, NS, "old"] = old
    async with operator():
        await wait_for(lambda: _status(k8s).get("endpoint"), what="demo reconciled")
        await wait_for(lambda: _status(k8s, "old").get("endpoint"), what="old reconciled")
        await wait_for(lambda: handlers.LEGACY_FINALIZER not in
                       ((_obj(k8s, PDC, "old") or {}).get("metadata", {}).get("finalizers") or []),
                       what="legacy finalizer removed")
        # the periodic resync runs without one (it is not a kopf daemon)
        assert ("ns1", "demo") in handlers.RUNTIME.tasks
    assert not (_obj(k8s, PDC, "demo") or {})["metadata"].get("finalizers")
    # kopf removes exactly its own entry with a JSON patch (kmock does not evaluate JSON patches, a real API
    # server keeps "example.com/keep"), guarded by the resourceVersion it saw.
    json_patches = [r.data for r in list(k8s) if r.method == "PATCH" and r.url.path.endswith("/pdclusters/old")
                    and "json-patch" in (r.headers or {}).get("Content-Type", "")]
    assert json_patches and all(
        [op for op in ops if op["op"] != "test"] == [{"op": "remove", "path": "/metadata/finalizers/0"}]
        for ops in json_patches), json_patches
    assert _finalizers_added(k8s) == []


async def test_deleted_pdcluster_is_not_reconciled(k8s: Any, kubeconfig: Any) -> None:
    """While a PDCluster is being deleted (here: held by someone else's finalizer, as a foreground deletion
    or a terminating namespace holds it), its children's deletion must not make the operator re-apply them."""
    body = make_body()
    body["metadata"]["finalizers"] = ["example.com/hold"]
    k8s.objects[PDC, NS, "demo"] = body
    async with operator(resync=0.5):
        await wait_for(lambda: _status(k8s).get("endpoint"), what="first reconcile")
        assert await _http(k8s, "DELETE", "/apis/pdcluster.dev/v1alpha1/namespaces/ns1/pdclusters/demo") == 200
        assert (_obj(k8s, PDC, "demo") or {})["metadata"].get("deletionTimestamp")
        await wait_for(lambda: ("ns1", "demo") not in handlers.RUNTIME.tasks, what="resync task stopped")
        applies_before = len(_applies(k8s))
        status_patches_before = len([r for r in list(k8s) if r.method == "PATCH" and r.url.path.endswith("/status")])
        # The garbage collector (or the namespace controller) deletes the children...
        assert await _http(k8s, "DELETE", "/apis/apps/v1/namespaces/ns1/deployments/demo-prefill") == 200
        assert await _http(k8s, "DELETE", "/api/v1/namespaces/ns1/services/demo-router") == 200
        # ...the operator sees it (the owner is kicked), and still does nothing.
        await wait_for(lambda: (ev := handlers.RUNTIME.kicks.get(("ns1", "demo"))) is not None and ev.is_set(),
                       what="the child deletions seen")
        assert _obj(k8s, "apps/v1/deployments", "demo-prefill") is None
        assert _obj(k8s, "v1/services", "demo-router") is None
        assert len(_applies(k8s)) == applies_before
        assert len([r for r in list(k8s) if r.method == "PATCH" and r.url.path.endswith("/status")]) \
            == status_patches_before
    assert _cond(_status(k8s), "Degraded")["status"] == "False"
    assert _finalizers_added(k8s) == []


async def test_namespace_terminating_is_quiet(k8s: Any, kubeconfig: Any) -> None:
    """Every create in a terminating namespace is refused with 403 NamespaceTerminating: no Degraded,
    no Warning Event, no kopf retry; the resync keeps running (it ends when the PDCluster goes)."""
    def creates_content(r: Any) -> bool:
        if r.url.path.endswith("/events") or r.url.path.endswith("/status"):
            return False
        return r.method == "POST" or (r.method == "PATCH" and "apply-patch" in (r.headers or {}).get("Content-Type", ""))

    k8s.rejections = [(creates_content, kmock.KubernetesError(
        status=403, reason="Forbidden",
        message="secrets \"demo-kv-secret\" is forbidden: unable to create new content in namespace ns1 "
                "because it is being terminated",
        details={"name": "demo-kv-secret", "kind": "secrets", "causes": [
            {"type": "NamespaceTerminating", "message": "namespace ns1 is being terminated",
             "field": "metadata.namespace"}]}))]
    k8s.objects[PDC, NS, "demo"] = make_body()
    async with operator(resync=0.2) as runner:
        # the create handler ran to completion (kopf recorded it as handled)...
        await wait_for(lambda: "pdcluster.dev/last-handled-configuration" in
                       ((_obj(k8s, PDC, "demo") or {}).get("metadata", {}).get("annotations") or {}),
                       what="create handled")
        # ...and the resync tried again a few times
        await wait_for(lambda: len(k8s.rejected) >= 3, what="three refused creates")
    assert _status(k8s) == {}  # no Degraded (nor anything else) written
    assert _events(k8s, "ApplyFailed") == []
    assert not [r for r in list(k8s) if r.method == "POST" and r.url.path.endswith("/events")
                and (r.data or {}).get("type") == "Warning"]
    assert "will retry" not in runner.output and "retrying" not in runner.output, runner.output[-3000:]
    assert runner.exception is None
