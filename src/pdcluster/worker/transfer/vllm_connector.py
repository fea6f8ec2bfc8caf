"""vLLM's `--kv-transfer-config` for a pdcluster worker: one declaration for the operator's pods and `up`'s
processes (stdlib only: the operator imports it).

- `NixlConnector`, `kv_both`: every worker can take either leg, so a pool's role is the router's choice (and a
  role flip needs no restart).
- `kv_buffer_device`: where the KV lives, `cuda` on GPU pools, `cpu` on CPU ones.
- `kv_load_failure_policy: recompute`: vLLM's default (`fail`) ends a decode request whose KV could not be read
  with a 500 event inside a stream the client already holds (seen under load in CI: a prefill worker too busy
  to serve the read). Recomputing the missing blocks on the decode worker keeps the answer whole; the failure
  is still counted (`vllm:nixl_num_failed_transfers`), which the operator reads into `KVTransferDegraded`.
"""

from __future__ import annotations

import json
from typing import Any

LOAD_FAILURE_POLICY = "recompute"


def kv_transfer_config(on_gpus: bool) -> dict[str, Any]:
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cuda" if on_gpus else "cpu",
            "kv_load_failure_policy": LOAD_FAILURE_POLICY}


def kv_transfer_arg(on_gpus: bool) -> str:
    """The config as vLLM's `--kv-transfer-config` takes it (compact JSON)."""
    return json.dumps(kv_transfer_config(on_gpus), separators=(",", ":"))
