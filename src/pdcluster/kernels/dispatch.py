"""Public entry points: validate once, then route to the Triton kernels or the torch path.

``backend="auto"`` uses Triton for CUDA tensors and torch otherwise; ``"triton"`` forces Triton (on CPU only
under ``TRITON_INTERPRET=1``); ``"torch"`` forces the reference. Triton is imported lazily so that importing
``pdcluster.kernels`` never requires it (and never fixes the interpreter choice too early).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from pdcluster.kernels.reference import paged_decode_attention_torch, write_kv_cache_torch
from pdcluster.kernels.validate import check_attention, check_write

BACKENDS = ("auto", "torch", "triton")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str, device: torch.device) -> str:
    """Pick "torch" or "triton" for tensors on ``device``, or raise ValueError naming ``backend``/device."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if not triton_available():
        raise ValueError("backend='triton' but triton is not installed")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend='triton' on device {device} needs CUDA tensors or TRITON_INTERPRET=1")
    return "triton"


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """One query token per sequence against its paged KV cache; returns ``[seqs, heads, head_dim]`` in q.dtype.

    q ``[seqs, heads, head_dim]``; caches ``[num_blocks, block_size, kv_heads, head_dim]`` (float or int8) or
    uint8 ``[..., head_dim // 2]`` (packed int4) with float32 scales ``[num_blocks, block_size, kv_heads]``;
    block_tables int32 ``[seqs, max_blocks]``; seq_lens int32 ``[seqs]`` (0 gives a zero row).
    """
    info = check_attention(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale)
    if resolve_backend(backend, q.device) == "torch":
        return paged_decode_attention_torch(
            q, k_cache, v_cache, block_tables, seq_lens, info, scale=scale, k_scale=k_scale, v_scale=v_scale
        )
    from pdcluster.kernels.paged_attention import paged_decode_attention_triton

    return paged_decode_attention_triton(
        q, k_cache, v_cache, block_tables, seq_lens, info, scale=scale, k_scale=k_scale, v_scale=v_scale
    )


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """Scatter new tokens' K/V ``[tokens, kv_heads, head_dim]`` into the paged cache in place.

    ``slot = block * block_size + offset``; negative slots are padding and skipped. int8/int4 caches are
    quantized on the fly (per-vector scales written to k_scale / v_scale).
    """
    info = check_write(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if resolve_backend(backend, k.device) == "torch":
        write_kv_cache_torch(k, v, k_cache, v_cache, slot_mapping, info, k_scale=k_scale, v_scale=v_scale)
        return
    from pdcluster.kernels.write_kv import write_kv_cache_triton

    write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping, info, k_scale=k_scale, v_scale=v_scale)
