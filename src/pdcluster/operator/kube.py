"""A thin async Kubernetes API client for the few calls the operator makes (aiohttp).

Credentials come from the in-cluster service account or the current kubeconfig (resolved by the
`kubernetes` package, which also refreshes exec/in-cluster tokens). Children are written with
server-side apply under one fixed field manager and `force=true`: the operator owns the fields it
renders, and re-applying unchanged objects is a no-op on the server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from typing import Any
from urllib.parse import quote

import aiohttp

from pdcluster.operator import models

log = logging.getLogger(__name__)

FIELD_MANAGER = "pdcluster-operator"

# (apiVersion, kind) -> plural; every kind the operator reads or writes.
PLURALS: dict[tuple[str, str], str] = {
    ("apps/v1", "Deployment"): "deployments",
    ("v1", "Service"): "services",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Secret"): "secrets",
    ("v1", "Pod"): "pods",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    (f"{models.API_GROUP}/{models.API_VERSION}", models.KIND): models.PLURAL,
}
PDC_API_VERSION = f"{models.API_GROUP}/{models.API_VERSION}"


NAMESPACE_TERMINATING = "NamespaceTerminating"


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str, method: str = "", path: str = "",
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(f"{method} {path}: {status} {reason}: {message}".strip())
        self.status = status
        self.reason = reason
        self.message = message
        self.details = details if isinstance(details, dict) else {}

    @property
    def retryable(self) -> bool:
        return self.status in (0, 409, 429) or self.status >= 500

    @property
    def namespace_terminating(self) -> bool:
        """A 403 because the namespace is being deleted: creating anything in it is refused until it is gone.
        The API server says so with reason Forbidden, a `NamespaceTerminating` cause in `details`, and the
        message "... unable to create new content in namespace X because it is being terminated"."""
        if self.status != 403:
            return False
        causes = self.details.get("causes") or []
        if any(isinstance(c, dict) and c.get("type") == NAMESPACE_TERMINATING for c in causes):
            return True
        return self.reason == NAMESPACE_TERMINATING or "because it is being terminated" in self.message


def resource_path(api_version: str, plural: str, namespace: str | None = None, name: str | None = None,
                  subresource: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = base
    if namespace:
        path += f"/namespaces/{quote(namespace)}"
    path += f"/{plural}"
    if name:
        path += f"/{quote(name)}"
    if subresource:
        path += f"/{subresource}"
    return path


def object_path(obj: dict[str, Any]) -> str:
    key = (obj["apiVersion"], obj["kind"])
    if key not in PLURALS:
        raise KeyError(f"unknown kind {key}")
    meta = obj["metadata"]
    return resource_path(obj["apiVersion"], PLURALS[key], meta.get("namespace"), meta["name"])


def load_configuration() -> Any:
    """A `kubernetes.client.Configuration`: in-cluster service account, else $KUBECONFIG (read now, not
    when `kubernetes` was imported) or ~/.kube/config. Blocking (may run an exec credential plugin)."""
    from kubernetes import client, config  # imported lazily: only the operator process needs it

    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException:
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None, client_configuration=cfg)
    return cfg


def bearer_token(cfg: Any) -> tuple[str | None, str | None]:
    """(scheme, token) from a Configuration (handles both the old and the new api_key slot)."""
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    parts = header.split(" ", 1) if header else []
    if not parts:
        return None, None
    return (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])


class Kube:
    def __init__(self, host: str, *, auth: Any = None, ssl_context: ssl.SSLContext | bool = True,
                 timeout: float = 30.0) -> None:
        self.host = host.rstrip("/")
        self._auth = auth  # a kubernetes.client.Configuration (for fresh tokens) or None
        self._ssl = ssl_context
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    async def from_environment(cls) -> Kube:
        """In-cluster service account first, then $KUBECONFIG / ~/.kube/config."""
        cfg = await asyncio.to_thread(load_configuration)
        ctx: ssl.SSLContext | bool = True
        if cfg.host.startswith("https"):
            if cfg.verify_ssl is False:
                ctx = False
            else:
                ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert) if cfg.ssl_ca_cert \
                    else ssl.create_default_context()
            if cfg.cert_file and cfg.key_file and isinstance(ctx, ssl.SSLContext):
                ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
        return cls(cfg.host, auth=cfg, ssl_context=ctx)

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "pdcluster-operator"}
        if self._auth is not None:
            for setting in (self._auth.auth_settings() or {}).values():
                if setting.get("in") == "header" and setting.get("value"):
                    headers[setting["key"]] = setting["value"]
        return headers

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, path: str, *, params: dict[str, str] | None = None,
                      body: Any = None, content_type: str = "application/json") -> dict[str, Any]:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        headers = self._headers()
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)  # JSON is valid YAML, so apply-patch+yaml bodies are JSON too
        try:
            async with self._session.request(method, self.host + path, params=params, data=data,
                                             headers=headers, ssl=self._ssl) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    reason, message, details = resp.reason or "", text[:300], None
                    try:
                        st = json.loads(text)
                        reason, message = st.get("reason") or reason, st.get("message") or message
                        details = st.get("details")
                    except (ValueError, AttributeError):
                        pass
                    raise ApiError(resp.status, str(reason), str(message), method, path, details)
                return json.loads(text) if text else {}
        except (TimeoutError, aiohttp.ClientError) as e:
            raise ApiError(0, type(e).__name__, str(e) or repr(e), method, path) from e

    # ---- verbs -----------------------------------------------------------------------------------

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        return await self.request(
            "PATCH", object_path(obj), params={"fieldManager": FIELD_MANAGER, "force": "true"},
            body=obj, content_type="application/apply-patch+yaml",
        )

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", resource_path(api_version, PLURALS[(api_version, kind)],
                                                           namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], PLURALS[(obj["apiVersion"], obj["kind"])], meta.get("namespace"))
        return await self.request("POST", path, params={"fieldManager": FIELD_MANAGER}, body=obj)

    async def list(self, api_version: str, kind: str, namespace: str | None,
                   label_selector: dict[str, str] | None = None) -> list[dict[str, Any]]:
        params = {}
        if label_selector:
            params["labelSelector"] = ",".join(f"{k}={v}" for k, v in label_selector.items())
        res = await self.request("GET", resource_path(api_version, PLURALS[(api_version, kind)], namespace),
                                 params=params)
        items = res.get("items") or []
        if label_selector:  # servers filter; be strict anyway
            items = [i for i in items
                     if all((i.get("metadata", {}).get("labels") or {}).get(k) == v
                            for k, v in label_selector.items())]
        return items

    async def merge_patch(self, api_version: str, kind: str, namespace: str | None, name: str,
                          patch: dict[str, Any], subresource: str | None = None) -> dict[str, Any]:
        path = resource_path(api_version, PLURALS[(api_version, kind)], namespace, name, subresource)
        return await self.request("PATCH", path, body=patch, content_type="application/merge-patch+json")

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        try:
            await self.request("DELETE", resource_path(api_version, PLURALS[(api_version, kind)], namespace, name))
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise
