"""Deletion and namespace termination, without kopf: a PDCluster being deleted is never reconciled, and a
403 because the namespace is being terminated is a quiet no-op, not Degraded (findings of the e2e suite
against a real kube-apiserver). Also: the handlers need no finalizer."""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import Any

import pytest

from pdcluster.operator import handlers, opmetrics
from pdcluster.operator import reconcile as rec
from pdcluster.operator.kube import ApiError

from .conftest import make_body

TERMINATING_MESSAGE = ('deployments.apps "demo-prefill" is forbidden: unable to create new content in namespace '
                       'ns1 because it is being terminated')
TERMINATING_DETAILS = {"name": "demo-prefill", "group": "apps", "kind": "deployments", "causes": [
    {"type": "NamespaceTerminating", "message": "namespace ns1 is being terminated", "field": "metadata.namespace"}]}


def terminating_error() -> ApiError:
    """The error a real kube-apiserver returns for a create in a terminating namespace."""
    return ApiError(403, "Forbidden", TERMINATING_MESSAGE, "PATCH", "/apis/apps/v1/...", TERMINATING_DETAILS)


class FakeKube:
    """Records every call; `fail_on(verb)` makes that verb raise the given error."""

    def __init__(self, pdcluster: dict[str, Any] | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.errors: dict[str, ApiError] = {}
        self.pdcluster = pdcluster
        self.host = "fake"

    def _maybe_fail(self, verb: str) -> None:
        if verb in self.errors:
            raise self.errors[verb]

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        self.calls.append(("get", (kind, name)))
        if kind == "PDCluster":
            return self.pdcluster
        if kind == "Secret":
            return {"data": {"key": base64.b64encode(b"k" * 32).decode()}}
        return None

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("create", (obj["kind"], obj["metadata"]["name"])))
        self._maybe_fail("create")
        return obj

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("apply", (obj["kind"], obj["metadata"]["name"])))
        self._maybe_fail("apply")
        return obj

    async def list(self, *a: Any, **kw: Any) -> list[dict[str, Any]]:
        self.calls.append(("list", a))
        return []

    async def merge_patch(self, api_version: str, kind: str, namespace: str | None, name: str,
                          patch: dict[str, Any], subresource: str | None = None) -> dict[str, Any]:
        self.calls.append(("merge_patch", (kind, name, subresource, patch)))
        return patch

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        self.calls.append(("delete", (kind, name)))
        return False

    def verbs(self) -> set[str]:
        return {v for v, _ in self.calls}


def _ctx(kube: FakeKube, events: list[tuple[str, str]]) -> rec.Context:
    return rec.Context(kube=kube, emit=lambda body, t, reason, msg: events.append((t, reason)),  # type: ignore[arg-type]
                       now=lambda: 1_800_000_000.0)


def _deleting_body() -> dict[str, Any]:
    body = make_body()
    body["metadata"]["deletionTimestamp"] = "2026-01-01T00:05:00Z"
    body["metadata"]["finalizers"] = ["foregroundDeletion"]
    return body


def _counter(trigger: str, result: str) -> float:
    return opmetrics.REGISTRY.get_sample_value("pdcluster_operator_reconciles_total",
                                               {"trigger": trigger, "result": result}) or 0.0


def test_namespace_terminating_is_recognised() -> None:
    assert terminating_error().namespace_terminating
    # by the cause alone, by the message alone (older servers), by a reason some clients use
    assert ApiError(403, "Forbidden", "forbidden", details=TERMINATING_DETAILS).namespace_terminating
    assert ApiError(403, "Forbidden", TERMINATING_MESSAGE).namespace_terminating
    assert ApiError(403, "NamespaceTerminating", "x").namespace_terminating
    # an RBAC 403 is not; nor another status with the same words
    assert not ApiError(403, "Forbidden", 'deployments.apps is forbidden: User "x" cannot create').namespace_terminating
    assert not ApiError(422, "Invalid", TERMINATING_MESSAGE).namespace_terminating
    assert not ApiError(403, "Forbidden", "x", details={"causes": "not-a-list"}).namespace_terminating
    assert not terminating_error().retryable


async def test_a_deleting_pdcluster_is_not_reconciled() -> None:
    kube, events = FakeKube(), []
    before = _counter("resync", "skipped")
    out = await rec.reconcile(_ctx(kube, events), _deleting_body(), "resync")
    assert out.skipped == "deleting" and out.degraded is None
    assert kube.calls == [] and events == []  # no read, no apply, no drain, no status, no Event
    assert _counter("resync", "skipped") == before + 1


async def test_a_deleting_pdcluster_is_not_drained() -> None:
    # A scale-down is pending (5 decode pods running, 2 wanted), but the PDCluster is being deleted.
    kube, events = FakeKube(), []
    body = _deleting_body()
    body["status"] = {"decode": {"desiredReplicas": 5}}
    out = await rec.reconcile(_ctx(kube, events), body, "child")
    assert out.skipped == "deleting"
    assert not {"list", "merge_patch", "apply"} & kube.verbs()


@pytest.mark.parametrize("verb", ["apply", "create"])
async def test_namespace_terminating_is_a_quiet_no_op(verb: str) -> None:
    kube, events = FakeKube(), []
    kube.errors[verb] = terminating_error()
    if verb == "create":  # the KV secret does not exist yet: created with POST, refused first
        kube.get = _no_secret(kube.get)  # type: ignore[method-assign]
    out = await rec.reconcile(_ctx(kube, events), make_body(), "child")
    assert out.skipped == "namespace-terminating" and out.degraded is None
    assert events == []  # no Warning Event
    # no Degraded written: the status is never patched
    assert not [c for c in kube.calls if c[0] == "merge_patch"]


def _no_secret(get: Any) -> Any:
    async def wrapped(api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        return None if kind == "Secret" else await get(api_version, kind, namespace, name)

    return wrapped


async def test_other_403s_are_still_degraded() -> None:
    kube, events = FakeKube(), []
    kube.errors["apply"] = ApiError(403, "Forbidden", 'deployments.apps "demo-prefill" is forbidden: User '
                                                      '"system:serviceaccount:x:y" cannot patch resource')
    out = await rec.reconcile(_ctx(kube, events), make_body(), "child")
    assert out.degraded and out.skipped is None
    assert events == [("Warning", "ApplyFailed")]
    status = [c[1][3] for c in kube.calls if c[0] == "merge_patch" and c[1][2] == "status"]
    deg = [c for c in status[-1]["status"]["conditions"] if c["type"] == "Degraded"][0]
    assert deg["status"] == "True" and deg["reason"] == "ApplyFailed"


@pytest.fixture()
def fake_runtime() -> Any:
    saved = handlers.RUNTIME
    handlers.RUNTIME = handlers._Runtime()
    try:
        yield handlers.RUNTIME
    finally:
        handlers.RUNTIME = saved


async def test_handlers_stop_at_a_deleting_pdcluster(fake_runtime: Any) -> None:
    """The resync (kicked by a child's deletion while the namespace goes) re-reads the PDCluster; being
    deleted, it applies nothing and the loop ends."""
    kube = FakeKube(pdcluster=_deleting_body())
    fake_runtime.kube = kube
    assert await handlers._reconcile_locked({"metadata": {"name": "demo", "namespace": "ns1"}}, "child") is None
    assert kube.verbs() == {"get"}
    stop, kick = asyncio.Event(), asyncio.Event()
    kick.set()  # a child was deleted
    await asyncio.wait_for(handlers._resync_loop("demo", "ns1", stop, logging.getLogger("t"), kick, 3600.0), 30)
    assert kube.verbs() == {"get"}


async def test_resync_task_starts_once_and_stops(fake_runtime: Any) -> None:
    kube = FakeKube(pdcluster=make_body())
    fake_runtime.kube = kube
    log = logging.getLogger("t")
    assert fake_runtime.start_resync("ns1", "demo", 3600.0, log)
    assert not fake_runtime.start_resync("ns1", "demo", 3600.0, log)  # already running
    await fake_runtime.stop_resync("ns1", "demo")
    await asyncio.sleep(0)  # let the done-callback run
    assert ("ns1", "demo") not in fake_runtime.tasks
    assert kube.calls == []  # stopped before its first pass
    await fake_runtime.stop_resync("ns1", "demo")  # idempotent
    await fake_runtime.stop_all()


async def test_track_pdcluster_stops_the_task_when_deletion_starts(fake_runtime: Any) -> None:
    fake_runtime.kube = FakeKube(pdcluster=make_body())
    log = logging.getLogger("t")
    await handlers.track_pdcluster(type=None, body=make_body(), name="demo", namespace="ns1", logger=log)
    assert ("ns1", "demo") in fake_runtime.tasks
    await handlers.track_pdcluster(type="MODIFIED", body=_deleting_body(), name="demo", namespace="ns1", logger=log)
    await asyncio.sleep(0)
    assert ("ns1", "demo") not in fake_runtime.tasks
    # a later event of the deleting object does not start it again
    await handlers.track_pdcluster(type="MODIFIED", body=_deleting_body(), name="demo", namespace="ns1", logger=log)
    assert ("ns1", "demo") not in fake_runtime.tasks


def test_no_handler_requires_a_finalizer() -> None:
    """kopf adds its finalizer only for daemons, timers and mandatory on.delete handlers. The operator has
    none: an uninstalled operator must not leave PDClusters (and their namespaces) Terminating."""
    import kopf

    registry = kopf.get_default_registry()
    ours = [h for h in registry._spawning.get_all_handlers() + registry._changing.get_all_handlers()
            if getattr(h.fn, "__module__", "") == handlers.__name__]
    assert ours, "the handlers module registered nothing?"
    assert not [h.id for h in ours if h.requires_finalizer], "a handler makes kopf add a finalizer"
    # in particular no kopf.daemon/kopf.timer (kopf 1.45 hard-wires requires_finalizer=True for both)
    assert not [h for h in registry._spawning.get_all_handlers() if h.fn.__module__ == handlers.__name__]
