"""Shared by the kopf-handler tests: the operator under kopf.testing.KopfRunner against kmock, the RBAC
guard every test runs under, and small readers of what the operator did to the emulated API."""

from __future__ import annotations

import asyncio
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


RBAC_RULES = yaml.safe_load((Path(__file__).resolve().parents[2] / "src" / "pdcluster" / "operator" / "rbac.yaml").read_text())["rules"]
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
