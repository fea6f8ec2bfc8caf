"""The kopf handlers end to end against kmock (the kopf author's Kubernetes API emulator), with the operator
running in `kopf.testing.KopfRunner` exactly as `kopf run -m pdcluster.operator.handlers` would."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import kmock
import pytest
from kopf.testing import KopfRunner

from pdcluster.operator import handlers

from .conftest import make_body, make_spec

PDC = "pdcluster.dev/v1alpha1/pdclusters"
NS = "ns1"


def _obj(k8s: Any, res: str, name: str, ns: str = NS) -> dict[str, Any] | None:
    key = (res, ns, name)
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


def _status(k8s: Any, name: str = "demo") -> dict[str, Any]:
    return (_obj(k8s, PDC, name) or {}).get("status") or {}


def _cond(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for c in status.get("conditions") or []:
        if c["type"] == type_:
            return c
    return None


def _applies(k8s: Any) -> list[Any]:
    return [r for r in k8s.requests if r.method == "PATCH" and
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
                                                     "ScalingLimited"}
    assert _cond(st, "Ready")["status"] == "False"
    assert _cond(st, "Degraded")["status"] == "False"
    # The status went through the status subresource.
    assert any(r.method == "PATCH" and r.url.path.endswith("/pdclusters/demo/status") for r in k8s.requests)
