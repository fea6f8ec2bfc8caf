"""`pdcluster up --engine vllm`: vLLM prefill/decode workers as local processes, from the vLLM environment.

vLLM pins its own torch, so it runs from a separate environment (`scripts/setup.sh vllm` builds it at
~/.cache/pdcluster/vllm-venv; $PDCLUSTER_VLLM_PYTHON names another interpreter). Each worker is vLLM's
OpenAI server with the NixlConnector, on loopback: UCX over TCP on `lo` (shared memory alone fails there),
its own NIXL side-channel port, and explicit OpenMP settings (with a KV connector vLLM's `auto` binding
reserves cores a small machine does not have). The router in front runs with `--engine vllm`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from pdcluster.worker.transfer.vllm_connector import kv_transfer_arg

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
DEFAULT_VENV = Path.home() / ".cache" / "pdcluster" / "vllm-venv"
# The NIXL side channel of the worker on HTTP port p is p + SIDE_CHANNEL_OFFSET (+ rank under TP).
SIDE_CHANNEL_OFFSET = 1000
START_TIMEOUT = 900.0  # vLLM takes minutes to start on a loaded CPU (model load, compile, KV profiling)


def vllm_python() -> Path:
    """The interpreter that runs vLLM: $PDCLUSTER_VLLM_PYTHON, else the cached environment's."""
    given = os.environ.get("PDCLUSTER_VLLM_PYTHON")
    return Path(given) if given else DEFAULT_VENV / "bin" / "python"


def missing_reason() -> str | None:
    """Why vLLM cannot run here (None: it can): the interpreter is absent."""
    py = vllm_python()
    if not py.is_file():
        return f"no vLLM environment at {py} (build it with `scripts/setup.sh vllm`, or set $PDCLUSTER_VLLM_PYTHON)"
    return None


def worker_cmd(args: argparse.Namespace, model: Path, role: str, port: int) -> list[str]:
    tp = int(getattr(args, f"{role}_tp", 1) or 1)
    cmd = [str(vllm_python()), "-m", VLLM_MODULE, "--model", str(model),
           # the name our engine serves a folder under, so clients need not know which engine runs
           "--served-model-name", model.resolve().name,
           # no --block-size: vLLM's CPU attention takes multiples of 32 only, and picks one itself
           "--host", args.host, "--port", str(port),
           "--kv-transfer-config", kv_transfer_arg(on_gpus=False),
           "--tensor-parallel-size", str(tp), "--disable-uvicorn-access-log"]
    max_len = getattr(args, "max_model_len", None)
    return cmd + (["--max-model-len", str(max_len)] if max_len else [])


def worker_env(args: argparse.Namespace, port: int) -> dict[str, str]:
    """The worker's environment; what the caller's environment already sets (e.g. VLLM_CPU_KVCACHE_SPACE) wins."""
    env = {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": args.host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port + SIDE_CHANNEL_OFFSET),
        "UCX_TLS": "tcp,sm,self",
        "UCX_NET_DEVICES": "lo",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: a small machine runs two of these
        "VLLM_NO_USAGE_STATS": "1",
        "OMP_NUM_THREADS": str(getattr(args, "threads", 1)),
    }
    return {k: v for k, v in env.items() if k not in os.environ}
