"""Paged KV cache allocation and sizing, one layer at a time.

Layout: ``[num_blocks, block_size, kv_heads, head_dim]`` for float and int8 caches; int4 caches are uint8
with ``head_dim // 2`` (two codes per byte). Quantized caches come with float32 scales
``[num_blocks, block_size, kv_heads]`` for K and for V.
"""

from __future__ import annotations

import torch

from pdcluster.kernels import hugepages

KV_DTYPES = ("auto", "int8", "int4")

KVCache = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def _check_kv_dtype(kv_dtype: str) -> None:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")


def kv_bits(kv_dtype: str) -> int | None:
    """8 or 4 for quantized kv dtypes, None for "auto" (the model dtype)."""
    _check_kv_dtype(kv_dtype)
    return {"auto": None, "int8": 8, "int4": 4}[kv_dtype]


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    kv_dtype: str = "auto",
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cpu",
) -> KVCache:
    """Zeroed (k_cache, v_cache, k_scale, v_scale) for one layer; scales are None for "auto". Host caches are
    madvised onto huge pages (hugepages.py): decode attention reads them in scattered rows every step.

    ``dtype`` is the float dtype used when ``kv_dtype == "auto"`` (the model dtype).
    """
    bits = kv_bits(kv_dtype)
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("kv_heads", kv_heads),
                        ("head_dim", head_dim)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if bits is None:
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a float dtype for kv_dtype='auto', got {dtype}")
        shape = (num_blocks, block_size, kv_heads, head_dim)
        return (hugepages.zeros(shape, dtype, device), hugepages.zeros(shape, dtype, device), None, None)
    if bits == 4 and head_dim % 2:
        raise ValueError(f"head_dim must be even for int4, got {head_dim}")
    last = head_dim if bits == 8 else head_dim // 2
    cache_dtype = torch.int8 if bits == 8 else torch.uint8
    shape = (num_blocks, block_size, kv_heads, last)
    scale_shape = (num_blocks, block_size, kv_heads)
    return (
        hugepages.zeros(shape, cache_dtype, device),
        hugepages.zeros(shape, cache_dtype, device),
        hugepages.zeros(scale_shape, torch.float32, device),
        hugepages.zeros(scale_shape, torch.float32, device),
    )


def kv_bytes_per_token(
    kv_heads: int,
    head_dim: int,
    kv_dtype: str = "auto",
    dtype: torch.dtype = torch.float16,
    layers: int = 1,
) -> int:
    """Bytes of K + V (+ their scales) one token occupies in the cache, over ``layers`` layers."""
    bits = kv_bits(kv_dtype)
    if bits is None:
        per_vec = head_dim * torch.empty((), dtype=dtype).element_size()
    else:
        per_vec = (head_dim * bits + 7) // 8 + 4  # codes + one float32 scale
    return 2 * kv_heads * per_vec * layers
