"""Tensor parallelism as the operator sees it: which layouts a pool may ask for, what one pod of a layout
requests, and the per-rank arithmetic of the sizing tools. Pure; never imports torch.

One worker pod is one *instance* of its pool: `pdcluster serve --tensor-parallel-size N` starts N ranks in
that pod, one per device, so a pod at TP N holds N GPUs of one node. Capacities (`C_p`, `C_d`) stay per
instance: TP changes how many GPUs an instance holds, not how the P:D formula counts instances.

The KV-head rule is the engine's (`pdcluster.worker.engine.parallel.heads`: split when kv_heads >= tp,
replicated on tp // kv_heads consecutive ranks otherwise), imported: that module is stdlib only, and
tests/test_layout.py allows the operator exactly it (as it allows the shared KV secret).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

import pdcluster.worker.engine.parallel.heads as heads

# One pod runs on one node, so TP is bounded by the GPUs of one node: 8 on today's HGX/DGX/MI300X
# boards, 16 on the largest (DGX-2 class). Powers of two only: head counts are powers of two in the
# model families served, and NVLink/xGMI partitions of a node come in powers of two.
TP_SIZES = (1, 2, 4, 8, 16)
TP_RULE_MESSAGE = "tensorParallelSize must be 1, 2, 4, 8 or 16 (a power of two; one pod's GPUs on one node)"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_COUNT_MESSAGE = ("resources: an explicit nvidia.com/gpu request or limit must equal tensorParallelSize "
                     "(one GPU per rank)")
# /dev/shm per rank: NCCL's shared-memory transport and torch's inter-process tensors (and gloo's
# peers on CPU) live there; tmpfs pages count against the pod's memory limit only when used.
SHM_GIB_PER_RANK = 2


def tp_error(tp: int) -> str | None:
    """Why `tp` is not a tensor-parallel size a pool may ask for (None: it is)."""
    return None if tp in TP_SIZES and not isinstance(tp, bool) else TP_RULE_MESSAGE


def explicit_gpu_counts(requests: Mapping[str, int | str], limits: Mapping[str, int | str]) -> list[int | str]:
    """The nvidia.com/gpu values a user wrote in a pool's resources (requests, then limits)."""
    return [m[GPU_RESOURCE] for m in (requests, limits) if GPU_RESOURCE in m]


def gpu_count_error(requests: Mapping[str, int | str], limits: Mapping[str, int | str], tp: int) -> str | None:
    """An explicit GPU count must equal the TP size. Compared as text, exactly as the CRD's CEL rule does
    (`string(value) == string(tp)`), so the API server and the operator refuse the same specs."""
    bad = [v for v in explicit_gpu_counts(requests, limits) if str(v) != str(tp)]
    if not bad:
        return None
    return f"{GPU_COUNT_MESSAGE} (tensorParallelSize {tp}, nvidia.com/gpu {bad[0]!s})"


def runs_on_gpus(requests: Mapping[str, int | str], limits: Mapping[str, int | str],
                 node_selector: Mapping[str, str], toleration_keys: Iterable[str | None]) -> bool:
    """Does this pool run on NVIDIA GPUs? Yes when its resources name nvidia.com/gpu, or the spec selects
    GPU nodes (a nodeSelector key under nvidia.com/gpu, e.g. GPU feature discovery's
    `nvidia.com/gpu.present`) or tolerates their taint (key nvidia.com/gpu). A CPU cluster says none of
    these and never requests a GPU."""
    if explicit_gpu_counts(requests, limits):
        return True
    if any(k == GPU_RESOURCE or k.startswith(GPU_RESOURCE + ".") for k in node_selector):
        return True
    return any(k == GPU_RESOURCE for k in toleration_keys)


def shm_size_limit(tp: int) -> str:
    """The /dev/shm emptyDir's sizeLimit for a pod of `tp` ranks (2Gi at TP 1, as before TP existed)."""
    return f"{SHM_GIB_PER_RANK * max(1, tp)}Gi"


# ---- sizing arithmetic (kv-budget, plan) ------------------------------------------------------------

def check_heads(num_kv_heads: int, tp: int, num_heads: int | None = None) -> None:
    """Raise ValueError unless `tp` can shard these heads: the engine's own rule and messages."""
    heads.check_layout(num_kv_heads, num_heads, tp)


def kv_heads_per_rank(num_kv_heads: int, tp: int, num_heads: int | None = None) -> int:
    """KV heads one rank holds in its cache: kv_heads / tp, or 1 (a replica) when kv_heads < tp."""
    check_heads(num_kv_heads, tp, num_heads)
    return len(heads.kv_heads_of_rank(num_kv_heads, tp, 0))


def kv_replication(num_kv_heads: int, tp: int) -> int:
    """How many ranks hold each KV head (1 unless kv_heads < tp)."""
    return len(heads.ranks_holding_head(num_kv_heads, tp, 0))


_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """'70B', '8e9', '1.5t', '7000m' -> a parameter count. ValueError for anything else."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbgt]?)\s*", text.lower())
    if not m:
        raise ValueError(f"{text!r} is not a parameter count (e.g. 70B, 8e9, 1.5T)")
    value = float(m.group(1)) * _SUFFIX[m.group(2)]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{text!r} must be a positive parameter count")
    return value


def weight_bytes_per_rank(params: float, bytes_per_param: float, tp: int) -> int:
    """Weights one rank holds: attention and MLP are column/row-parallel and embedding and LM head are
    vocab-parallel, so every large matrix is split tp ways; the replicated norms are < 0.01% of a model
    and ignored. An estimate (a real checkpoint's size is the exact figure)."""
    return int(math.ceil(params * bytes_per_param / tp))


def pool_gpus(replicas: int | None, gpus_per_pod: int) -> int | None:
    """GPUs a pool holds: replicas x GPUs per pod (None when the replica count is unknown)."""
    return None if replicas is None else int(replicas) * int(gpus_per_pod)
