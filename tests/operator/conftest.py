"""Fixtures for the operator tests: a kmock Kubernetes emulator that understands server-side apply's
create-on-apply, a kubeconfig pointing at it, and spec/body builders."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kmock
import pytest
from kmock._internal import enums  # the action enum (the public `kmock.action` is the same object)

RESOURCES: dict[str, dict[str, Any]] = {
    "pdcluster.dev/v1alpha1/pdclusters": {"kind": "PDCluster", "namespaced": True, "subresources": ["status"],
                                          "singular": "pdcluster", "shortnames": ["pdc"]},
    "apps/v1/deployments": {"kind": "Deployment", "namespaced": True, "subresources": ["status", "scale"]},
    "v1/services": {"kind": "Service", "namespaced": True},
    "v1/configmaps": {"kind": "ConfigMap", "namespaced": True},
    "v1/secrets": {"kind": "Secret", "namespaced": True},
    "v1/pods": {"kind": "Pod", "namespaced": True},
    "v1/events": {"kind": "Event", "namespaced": True},
    "policy/v1/poddisruptionbudgets": {"kind": "PodDisruptionBudget", "namespaced": True},
    "networking.k8s.io/v1/networkpolicies": {"kind": "NetworkPolicy", "namespaced": True},
    # kopf's observers wait for these two to be discoverable (as they are on every real cluster).
    "v1/namespaces": {"kind": "Namespace", "namespaced": False},
    "apiextensions.k8s.io/v1/customresourcedefinitions": {"kind": "CustomResourceDefinition",
                                                          "namespaced": False},
}
VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}


class ApplyingEmulator(kmock.KubernetesEmulator):
    """kmock's emulator treats every PATCH as a merge patch of an existing object. A real API server
    *creates* the object on a server-side apply (`application/apply-patch+yaml`) when it is missing;
    emulate exactly that, then let kmock merge the same body as usual."""

    # (predicate(request) -> bool, HTTP status) consumed one by one: injected API failures.
    failures: list[tuple[Any, int]] = []
    # (predicate(request) -> bool, error) never consumed: every matching request fails; `rejected` records them.
    rejections: list[tuple[Any, kmock.KubernetesError]] = []
    rejected: list[Any] = []

    async def _handle(self, request: Any) -> Any:
        for i, (pred, code) in enumerate(list(self.failures)):
            if pred(request):
                del self.failures[i]
                raise kmock.KubernetesError(status=code, reason="InjectedFailure", message="injected by the test")
        for pred, error in self.rejections:
            if pred(request):
                self.rejected.append(request)
                raise error
        ctype = (request.headers or {}).get("Content-Type", "")
        if (request.resource is not None and request.action == enums.action.UPDATE
                and "apply-patch" in ctype and request.name and not request.subresource):
            key = (request.resource, request.namespace, request.name)
            async with self._lock:
                if key not in self._objects or self._objects[key].deleted:
                    data = copy.deepcopy(request.data)
                    if key not in self._objects:
                        self._objects[key] = data
                    else:
                        self._objects[key].create(data)
                    await self._buses[request.resource].put({"type": "ADDED", "object": data})
        return await super()._handle(request)


@pytest.fixture()
def kmock_options() -> dict[str, Any]:
    return {"cls": ApplyingEmulator}


@pytest.fixture()
def k8s(kmock: ApplyingEmulator) -> ApplyingEmulator:
    kmock.failures = []
    kmock.rejections = []
    kmock.rejected = []
    for res, info in RESOURCES.items():
        kmock.resources[res] = kmock.ResourceInfo(verbs=VERBS, **info)
    return kmock


@pytest.fixture()
def kubeconfig(k8s: ApplyingEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: kmock\n"
        f"clusters:\n- name: kmock\n  cluster:\n    server: {str(k8s.url).rstrip('/')}\n"
        "users:\n- name: tester\n  user:\n    token: test-token\n"
        "contexts:\n- name: kmock\n  context:\n    cluster: kmock\n    user: tester\n"
    )
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return path


def make_spec(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": "tiny", "uri": "file:///models/tiny"},
        "image": "ghcr.io/example/pdcluster:0.1.0",
        "prefill": {"replicas": 1, "minReplicas": 1, "maxReplicas": 4},
        "decode": {"replicas": 2, "minReplicas": 1, "maxReplicas": 8},
    }
    for k, v in overrides.items():
        spec[k] = v
    return spec


def make_body(name: str = "demo", namespace: str = "ns1", spec: dict[str, Any] | None = None,
              generation: int = 1, status: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "pdcluster.dev/v1alpha1",
        "kind": "PDCluster",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "generation": generation,
                     "resourceVersion": "1", "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": spec if spec is not None else make_spec(),
    }
    if status is not None:
        body["status"] = status
    return body
