"""Paged decode attention on the CPU through the native AVX-512 kernel (``attention.cpp``).

One query token per sequence reads its keys and values straight from the paged cache through the block table:
no gathered copy, online softmax, the query heads of a KV head sharing every row read, an optional sliding
window and tanh soft-cap. Caches: fp32, fp16, bf16, int8 and packed int4 (head_dim a multiple of 32) with
their float32 per-(token, head) scales, the layouts of ``pdcluster.kernels``. Math is float32.

:func:`available` says whether the kernel can serve a cache layer here; callers keep their torch path for
every other case (no AVX-512 or compiler, ``PDCLUSTER_NATIVE_KERNELS=0``, a CUDA cache).
``PDCLUSTER_NATIVE_KERNELS=-attention`` turns off this kernel alone (e.g. to compare it served beside the
other native kernels).
"""

from __future__ import annotations

from types import ModuleType

import torch

from pdcluster.kernels.cpu import native, step

# Work (positions x KV heads) below which the kernel stays on the calling thread. Shared through the step's
# pool (pool.h), whose helpers are awake during a step, one layer at batch 16 @190 took 310 us vs 442 us alone
# and batch 1 @1024 58 vs 85 us (2026-12-02, load 0.8); at batch 1 @190 (760) the two are equal (15-16 us).
# (With at::parallel_for's fork/join it never paid below 65,536: docs/benchmarks/engine.md at 5f904a5.)
PARALLEL_MIN = 1024

_FLOAT = (torch.float32, torch.float16, torch.bfloat16)


def module() -> ModuleType | None:
    """The compiled kernel module, or None where it cannot be built (logged once by the loader)."""
    return step.module()


def supports(cache: torch.Tensor, head_dim: int) -> bool:
    """Whether the kernel handles a cache pool of this dtype/device and head dim (before loading it)."""
    if cache.device.type != "cpu" or not cache.is_contiguous():
        return False
    if cache.dtype in _FLOAT or cache.dtype == torch.int8:
        return cache.shape[-1] == head_dim
    if cache.dtype == torch.uint8:  # packed int4: the kernel unpacks 32 elements (16 bytes) at a time
        return head_dim % 32 == 0 and cache.shape[-1] == head_dim // 2
    return False


def available(cache: torch.Tensor, head_dim: int) -> bool:
    if not native.enabled("attention"):
        return False
    return supports(cache, head_dim) and module() is not None


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    parallel_min: int = PARALLEL_MIN,
) -> torch.Tensor:
    """``q [seqs, heads, head_dim]`` against the paged caches; returns ``[seqs, heads, head_dim]`` in q.dtype.

    Shapes as ``pdcluster.kernels.paged_decode_attention``; ``window`` keeps the last ``window`` positions
    (transformers' sliding window), ``softcap`` applies ``tanh(s / cap) * cap`` to the scaled scores. A row
    with seq_len 0 is zeros. Bad shapes, dtypes or table entries raise (RuntimeError from the kernel).
    """
    mod = module()
    if mod is None:
        raise RuntimeError(f"native CPU kernel {step.NAME} is not available here")
    # a slice of the fused QKV output is read in place: only each row's heads must be contiguous
    rows_ok = (q.dim() == 3 and q.stride(2) == 1 and q.stride(1) == q.shape[2]
               and q.stride(0) >= q.shape[1] * q.shape[2])
    qf = q if q.dtype is torch.float32 and rows_ok else q.float().contiguous()
    out = mod.paged_decode(
        qf, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens.contiguous(), float(scale),
        int(window or 0), float(softcap or 0.0), int(parallel_min),
    )
    return out if q.dtype == torch.float32 else out.to(q.dtype)
