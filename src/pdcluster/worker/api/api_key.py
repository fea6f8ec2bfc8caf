"""Optional API key (`--api-key` or $PDCLUSTER_API_KEY), one rule for the worker and the router: with a key,
every route needs `Authorization: Bearer <key>` except the probes and scrapes (/health, /live, /metrics,
/version), which carry no key. That covers what generates (/v1/*, /internal/generate, ...), tokenizes
(/tokenize, /internal/tokenize), drains (/drain, /undrain) and reveals state (/cluster, /internal/load,
/internal/prefix-events, /openapi.json), with or without a KV secret. Where a KV secret is configured its derived
internal token is accepted too (the router's /internal/* calls carry it; those routes still require it then).
The scheme `Bearer` is matched case-insensitively (RFC 7235)."""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response

from pdcluster.worker.api import errors
from pdcluster.worker.transfer.secret import check_internal_auth

ENV_VAR = "PDCLUSTER_API_KEY"
OPEN = frozenset({"/health", "/live", "/metrics", "/version"})


def resolve(flag: str | None) -> str | None:
    """The key from the flag, else the environment; empty means none."""
    return flag or os.environ.get(ENV_VAR) or None


def needs_key(path: str) -> bool:
    return path.rstrip("/") not in OPEN


def bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (any case of `Bearer`), else None."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def key_ok(expected: str, authorization: str | None) -> bool:
    token = bearer(authorization)
    return token is not None and hmac.compare_digest(token.encode(), expected.encode())


def install(app: FastAPI, key: str | None) -> None:
    """Refuse every route but OPEN without the key (401, OpenAI's shape); no-op without a key. The app's
    `state.internal_secret` (a worker's KV secret), when set, makes its internal token a valid credential too."""
    if not key:
        return

    @app.middleware("http")
    async def _check(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if needs_key(request.url.path):
            auth = request.headers.get("authorization")
            secret = getattr(request.app.state, "internal_secret", None)
            if not (key_ok(key, auth) or (secret is not None and check_internal_auth(secret, auth))):
                return errors.APIError(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                                       type="authentication_error", code="invalid_api_key",
                                       headers={"WWW-Authenticate": "Bearer"}).response()
        return await call_next(request)
