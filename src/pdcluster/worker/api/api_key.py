"""Optional API key on the public OpenAI routes (`--api-key` or $PDCLUSTER_API_KEY), as vLLM's `--api-key`:
`Authorization: Bearer <key>` on /v1/*, /tokenize and /detokenize; health, metrics and version stay open
(probes and Prometheus carry no key)."""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response

from pdcluster.worker.api import errors

ENV_VAR = "PDCLUSTER_API_KEY"
GUARDED = ("/v1/", "/tokenize", "/detokenize")


def resolve(flag: str | None) -> str | None:
    """The key from the flag, else the environment; empty means none."""
    return flag or os.environ.get(ENV_VAR) or None


def needs_key(path: str) -> bool:
    return path.startswith(GUARDED)


def key_ok(expected: str, authorization: str | None) -> bool:
    if not authorization or not authorization.startswith("Bearer "):
        return False
    return hmac.compare_digest(authorization[len("Bearer "):].strip().encode(), expected.encode())


def install(app: FastAPI, key: str | None) -> None:
    """Refuse guarded routes without the key (401, OpenAI's shape); no-op without a key."""
    if not key:
        return

    @app.middleware("http")
    async def _check(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if needs_key(request.url.path) and not key_ok(key, request.headers.get("authorization")):
            return errors.APIError(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                                   type="authentication_error", code="invalid_api_key",
                                   headers={"WWW-Authenticate": "Bearer"}).response()
        return await call_next(request)
