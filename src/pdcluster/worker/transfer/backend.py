"""Which KV transfer backend a worker runs (`--kv-transfer-backend`, `spec.kvTransfer.backend`), and building
it. A pure decision plus one constructor, so that the choice and its one log line are tested without nixl.

auto: NIXL where it loads, else TCP (the portable fallback), with the reason in one log line.
nixl: NIXL, or a usage error naming why it does not load (asked for explicitly: never a silent downgrade).
tcp:  TCP (the authenticated channel carries the bytes too: for clusters whose fabric is not trusted).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdcluster.worker.transfer.nixl_agent import Availability
from pdcluster.worker.transfer.options import BACKENDS, TransferOptions

log = logging.getLogger(__name__)


class BackendUnavailable(ValueError):
    pass


@dataclass(frozen=True)
class Choice:
    backend: str  # "nixl" | "tcp"
    reason: str
    fallback: bool = False  # auto wanted nixl and could not have it: worth a warning

    @property
    def message(self) -> str:
        return f"kv transfer backend: {self.backend} ({self.reason})"


def choose(requested: str, nixl: Availability) -> Choice:
    """What runs for `requested` given whether NIXL loads here. Raises BackendUnavailable for an explicit
    `nixl` that cannot load."""
    if requested not in BACKENDS:
        raise ValueError(f"kv transfer backend must be one of {BACKENDS}, got {requested!r}")
    if requested == "tcp":
        return Choice("tcp", "asked for tcp")
    if nixl.ok:
        return Choice("nixl", f"{'asked for nixl' if requested == 'nixl' else 'auto'}: {nixl.reason}")
    if requested == "nixl":
        raise BackendUnavailable(f"--kv-transfer-backend nixl, but {nixl.reason}")
    return Choice("tcp", f"auto: {nixl.reason}; falling back to tcp", fallback=True)


def build(options: TransferOptions, secret: bytes, pools: Callable[[], list[Any]] | None = None,
          **kw: Any) -> tuple[Any, Choice]:
    """The connector for `options.backend` (a TCPConnector or NixlConnector) and the choice, logged once.
    `options.integrity` (mac | fabric): whether KV bytes are MAC'd and checked, or the fabric is trusted with
    them (both backends). NIXL's alone: `pools`, the engine's cache pools it registers once (float layers then
    move from cache blocks to cache blocks, nixl_direct.py)."""
    from pdcluster.worker.transfer.connector import TCPConnector
    from pdcluster.worker.transfer.nixl_agent import availability

    requested = options.backend
    choice = choose(requested, availability() if requested != "tcp" else Availability(False, "not probed"))
    (log.warning if choice.fallback else log.info)(choice.message)
    if options.integrity == "fabric":
        log.warning("kv transfer: KV bytes are not MAC-checked (--kv-transfer-integrity fabric; headers and the "
                    "connection still are): only on a fabric that protects them (mTLS/IPsec/WireGuard, RDMA)")
    if choice.backend == "nixl":
        from pdcluster.worker.transfer.nixl_connector import NixlConnector

        conn = NixlConnector(secret, options, **kw)
        if pools is not None:
            conn.register_cache(pools())
        return conn, choice
    return TCPConnector(secret, options, **kw), choice
