"""Where the KV-transfer HMAC secret comes from: a file (Kubernetes Secret mount) or an env variable."""

from __future__ import annotations

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
