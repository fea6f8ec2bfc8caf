"""Where the KV-transfer HMAC secret comes from: a file (Kubernetes Secret mount) or an env variable."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Mapping
from pathlib import Path

ENV_VAR = "PDCLUSTER_KV_SECRET"
MIN_SECRET_BYTES = 16  # shorter secrets are brute-forceable; refuse them rather than pretend


class SecretError(ValueError):  # a ValueError: `pdcluster serve` reports it as a usage error (exit 2)
    pass


def load_secret(secret_file: str | None = None, env: dict[str, str] | None = None) -> bytes:
    """The file wins over the environment so a mounted Secret cannot be shadowed by a stray env var.

    Raises SecretError when neither is set: frames must never travel unauthenticated.
    """
    source_env: Mapping[str, str] = os.environ if env is None else env
    if secret_file:
        raw = Path(secret_file).read_bytes().strip()
        source = secret_file
    elif source_env.get(ENV_VAR):
        raw = source_env[ENV_VAR].encode("utf-8").strip()
        source = f"${ENV_VAR}"
    else:
        raise SecretError(
            f"KV transfer needs a shared secret: pass --kv-transfer-secret-file or set {ENV_VAR} "
            "(the same value on every prefill and decode worker)"
        )
    if len(raw) < MIN_SECRET_BYTES:
        raise SecretError(f"KV transfer secret from {source} is shorter than {MIN_SECRET_BYTES} bytes")
    return raw


# Router -> worker `/internal/*` calls carry a key derived from the same secret (never the secret itself).
INTERNAL_AUTH_HEADER = "Authorization"
_INTERNAL_LABEL = b"pdcluster-internal-v1"


def worker_secret(secret_file: str | None, role: str) -> bytes | None:
    """A worker's KV secret: from the file or $PDCLUSTER_KV_SECRET when either is given (SecretError, a
    ValueError, names what is wrong with it), else None, with a warning for a prefill or decode worker: it
    cannot send or receive KV, and the router will prefill on decode workers instead."""
    if secret_file or os.environ.get(ENV_VAR):
        return load_secret(secret_file)
    if role in ("prefill", "decode"):
        logging.getLogger(__name__).warning(
            "no KV transfer secret (--kv-transfer-secret-file or $%s): this %s worker cannot send or receive "
            "KV; the router will prefill on decode workers instead", ENV_VAR, role)
    return None


def internal_token(secret: bytes) -> str:
    """Hex HMAC-SHA256(secret, "pdcluster-internal-v1"): what the router sends as `Bearer <token>`."""
    return hmac.new(secret, _INTERNAL_LABEL, hashlib.sha256).hexdigest()


def internal_headers(secret: bytes | None) -> dict[str, str]:
    """Headers for every router -> worker internal call ({} without a secret: local dev, as before)."""
    return {INTERNAL_AUTH_HEADER: f"Bearer {internal_token(secret)}"} if secret is not None else {}


def check_internal_auth(secret: bytes | None, header: str | None) -> bool:
    """True when no secret is configured, or `header` is `Bearer <the derived token>` (constant-time compare)."""
    if secret is None:
        return True
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), internal_token(secret).encode())


def optional_secret(secret_file: str | None = None, env: dict[str, str] | None = None) -> bytes | None:
    """load_secret when a file or the env var is given, else None; a given but unusable secret still raises."""
    source_env: Mapping[str, str] = os.environ if env is None else env
    if secret_file or source_env.get(ENV_VAR):
        return load_secret(secret_file, env)
    return None
