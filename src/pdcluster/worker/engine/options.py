"""The engine's options, declared once: name, type, default, choices, bounds and help of each (rows of
`pdcluster.worker.options.Option`, shared with the KV transfer's and the router's tables).

`pdcluster serve`'s engine flags are generated from this table (worker/server/cli.py), `EngineConfig.validate`
checks against it, and the operator's PDCluster spec models must offer the same choices and bounds (a contract
test holds them to it). No torch here: `pdcluster.operator` may import this module (its image has no torch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pdcluster.worker import options as declared
from pdcluster.worker.options import Option

BLOCK_SIZES = (8, 16, 32)
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "int8", "int4")
PREEMPTION_MODES = ("swap", "recompute", "auto")
DEVICES = ("cpu", "cuda")
WATERMARK_MAX = 0.5  # more would keep most of the cache idle


def parse_bytes(text: str) -> int:
    """BYTES, or with a K/M/G/Ki/Mi/Gi suffix (e.g. 512Mi)."""
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}
    t = text.strip().lower().removesuffix("b")
    scale = 1
    for suffix in sorted(units, key=len, reverse=True):
        if t.endswith(suffix):
            t, scale = t[: -len(suffix)], units[suffix]
            break
    try:
        v = float(t) * scale
    except ValueError:
        raise ValueError(f"{text!r} is not a byte count (e.g. 2000000000 or 2Gi)") from None
    if not math.isfinite(v) or v < 1:
        raise ValueError(f"{text!r} is not a byte count >= 1 (e.g. 2000000000 or 2Gi)")
    return int(v)


def parse_layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of layer indices") from None


ENGINE_OPTIONS: tuple[Option, ...] = (
    Option("device", "--device", str, "cpu", "where the model runs", choices=DEVICES),
    Option("dtype", "--dtype", str, "auto", "auto: float32 on CPU, the checkpoint's dtype on CUDA", choices=DTYPES),
    Option("block_size", "--block-size", int, 16, "KV cache tokens per block", choices=BLOCK_SIZES),
    Option("kv_cache_dtype", "--kv-cache-dtype", str, "auto", "KV cache element type (auto: the model dtype)",
           choices=KV_CACHE_DTYPES),
    Option("full_precision_layers", "--full-precision-layers", tuple, (),
           "layers whose KV cache stays in full precision under int8/int4", metavar="I,J,..", parse=parse_layers),
    Option("max_batch_size", "--max-batch-size", int, 16, "decode batch bound (useful range 8-32)", minimum=1,
           metavar="N"),
    Option("max_batch_tokens", "--max-batch-tokens", int, 2048, "prefill token budget per step", minimum=1,
           metavar="TOKENS"),
    Option("max_model_len", "--max-model-len", int, None,
           "longest prompt + output (default: the model's max_position_embeddings)", minimum=1, nullable=True,
           metavar="TOKENS"),
    Option("gpu_memory_utilization", "--gpu-memory-utilization", float, 0.9,
           "fraction of GPU memory for weights + KV cache (CUDA)", minimum=0.0, min_exclusive=True, maximum=1.0,
           metavar="F"),
    Option("kv_cache_memory", "--kv-cache-memory", int, None, "KV cache budget (CPU); e.g. 2Gi", minimum=1,
           nullable=True, metavar="BYTES", parse=parse_bytes),
    Option("swap_space", "--swap-space", float, 4.0, "host memory for swapped-out KV", minimum=0.0,
           metavar="GiB"),
    Option("preemption_mode", "--preemption", str, "auto", "what a preempted sequence does with its KV",
           choices=PREEMPTION_MODES),
    Option("watermark", "--swap-watermark", float, 0.15,
           "fraction of KV blocks kept free before admitting new work (useful 0.10-0.20)", minimum=0.0,
           maximum=WATERMARK_MAX, metavar="F"),
    Option("num_threads", "--threads", int, None, "torch CPU threads", minimum=1, nullable=True, metavar="N"),
)
BY_NAME: Mapping[str, Option] = {o.name: o for o in ENGINE_OPTIONS}


def validate(values: Mapping[str, Any]) -> None:
    """Check every declared option present in ``values`` (e.g. ``vars(EngineConfig)``)."""
    declared.validate(ENGINE_OPTIONS, values)
