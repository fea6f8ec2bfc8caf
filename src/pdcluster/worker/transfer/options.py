"""The KV transfer's options, declared once (rows of `pdcluster.worker.options.Option`).

`pdcluster serve`'s `--kv-transfer-*` flags and the ones `pdcluster up` hands to its workers are generated from
this table, `spec.kvTransfer`'s defaults are read from it (operator/models.py), and `TransferOptions` is what the
server passes down to the connector, the backend choice and each tensor-parallel rank's endpoint: nothing below
the command line has a default of its own for these knobs.

Stdlib only: the operator imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdcluster.worker import options as declared
from pdcluster.worker.options import Option

COMPRESSIONS = ("none", "int8")  # the wire format (codec.py)
BACKENDS = ("auto", "nixl", "tcp")  # backend.py
INTEGRITY = ("mac", "fabric")
TP_PATHS = ("auto", "direct", "relay")  # server/tp_direct.py

TRANSFER_OPTIONS: tuple[Option, ...] = (
    Option("port", "--kv-transfer-port", int, None, "the transfer listener's port (default: any free port, "
           "reported to the router; rank r of a tensor-parallel worker listens on PORT + r)", minimum=1,
           maximum=65535, nullable=True, metavar="PORT", dest="kv_transfer_port"),
    Option("compression", "--kv-transfer-compression", str, "none",
           "wire format of the KV cache: none (the cache dtype) or int8", choices=COMPRESSIONS,
           dest="kv_transfer_compression"),
    # auto: NIXL where it loads (RDMA/NVLink when there is one), else the portable TCP path, said in one log line
    Option("backend", "--kv-transfer-backend", str, "auto",
           "how KV bytes move: nixl (UCX: RDMA, NVLink, shared memory; its data plane is not authenticated, the "
           "bytes are MAC-checked), tcp (the authenticated channel), auto (nixl where it loads, else tcp; one log "
           "line says which and why)", choices=BACKENDS, dest="kv_transfer_backend"),
    # mac: safe on any network; fabric is an explicit decision of whoever knows the network protects the bytes
    Option("integrity", "--kv-transfer-integrity", str, "mac",
           "KV bytes, on either backend: mac (each layer tagged by the sender and checked before import; a pass "
           "over each layer on both sides) or fabric (trusted as they land, as vLLM's and Dynamo's connectors do: "
           "only where the network protects them, e.g. an isolated RDMA/NVLink fabric or mTLS/IPsec/WireGuard "
           "between nodes; the connection, frame headers and request ids stay authenticated). A mac receiver "
           "refuses a fabric sender's layers", choices=INTEGRITY, dest="kv_transfer_integrity",
           aliases=("--kv-transfer-nixl-integrity",)),
    # 30 s: generous next to a layer-streamed transfer (it ends about one layer after prefill does), short
    # enough that a lost peer's reserved blocks come back soon (the reaper waits twice this)
    Option("timeout_s", "--kv-transfer-timeout", float, 30.0, "bound on one KV transfer, in seconds",
           minimum=0.0, min_exclusive=True, metavar="S", dest="kv_transfer_timeout"),
    # 3: a worker restart or a dropped connection costs a reconnect or two; past that the router retries the
    # whole request on another pair, which is cheaper than waiting longer here
    Option("max_retries", "--kv-transfer-max-retries", int, 3,
           "reconnects of one failed transfer (only the frames not yet acknowledged are resent)", minimum=0,
           metavar="N", dest="kv_transfer_max_retries"),
    Option("secret_file", "--kv-transfer-secret-file", str, None,
           "shared secret authenticating prefill <-> decode peers and the router's /internal/* calls (else "
           "$PDCLUSTER_KV_SECRET; without one there is no transfer listener)", nullable=True, metavar="FILE",
           dest="kv_transfer_secret_file"),
    Option("tp_path", "--kv-transfer-tp-path", str, "auto",
           "KV between tensor-parallel layouts: direct (each rank sends/receives its own KV heads on its own "
           "endpoint, when the peer advertises it), relay (through rank 0 over the ranks' group) or auto (today "
           "the same as direct, on either backend)", choices=TP_PATHS, dest="kv_transfer_tp_path"),
)
BY_NAME = declared.by_name(TRANSFER_OPTIONS)


def default(name: str) -> Any:
    return BY_NAME[name].default


@dataclass(frozen=True)
class TransferOptions:
    """One worker's KV-transfer settings, built from the flags (`from_args`) and passed down as a whole.
    The field defaults are the table's (a test builds it from defaults); every value is checked against it."""

    port: int | None = default("port")
    compression: str = default("compression")
    backend: str = default("backend")
    integrity: str = default("integrity")
    timeout_s: float = default("timeout_s")
    max_retries: int = default("max_retries")
    secret_file: str | None = default("secret_file")
    tp_path: str = default("tp_path")

    def __post_init__(self) -> None:
        declared.check_fields(self, TRANSFER_OPTIONS)

    @classmethod
    def from_args(cls, args: Any) -> TransferOptions:
        """From a namespace parsed with `add_arguments`."""
        return cls(**declared.values_of(args, TRANSFER_OPTIONS))


def add_arguments(group: Any, names: tuple[str, ...] | None = None, *, help_prefix: str = "") -> None:
    """The `--kv-transfer-*` flags (all, or the rows named), generated from the table."""
    declared.add_arguments(group, rows(names), help_prefix=help_prefix)


def rows(names: tuple[str, ...] | None) -> tuple[Option, ...]:
    return TRANSFER_OPTIONS if names is None else tuple(BY_NAME[n] for n in names)
