"""The kopf handlers on deletion and namespace termination, and the absence of a finalizer: findings of the
e2e suite on a real API server, reproduced against kmock."""

from __future__ import annotations

from typing import Any

import kmock

from pdcluster.operator import handlers

from .conftest import make_body
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
