"""Argument checks shared by both backends: a wrong shape, dtype or device is a ValueError naming the
argument, never a silent wrong answer (torch) or an out-of-bounds read (Triton)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class CacheInfo:
    """What a (k_cache, v_cache, scales) tuple holds."""

    bits: int | None  # None = float cache, else 8 or 4
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int  # logical head dim (int4 caches store head_dim // 2 bytes)


def _tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def check_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    head_dim: int,
    device: torch.device,
    src: str = "q",
) -> CacheInfo:
    """Validate a paged cache pair against the logical ``head_dim`` of ``src`` (q, or k for writes)."""
    _tensor("k_cache", k_cache)
    _tensor("v_cache", v_cache)
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache: expected [num_blocks, block_size, kv_heads, head_dim], got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache: dtype {v_cache.dtype} must equal k_cache dtype {k_cache.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != device:
            raise ValueError(f"{name}: on {t.device}, expected {device} (same device as {src})")
    num_blocks, block_size, kv_heads, last = k_cache.shape
    if k_cache.dtype in FLOAT_DTYPES:
        bits = None
    elif k_cache.dtype == torch.int8:
        bits = 8
    elif k_cache.dtype == torch.uint8:
        bits = 4
    else:
        raise ValueError(f"k_cache: dtype {k_cache.dtype} is not fp32/fp16/bf16, int8 or uint8 (packed int4)")
    expect_last = head_dim // 2 if bits == 4 else head_dim
    if bits == 4 and head_dim % 2:
        raise ValueError(f"{src}: head_dim must be even for an int4 cache, got {head_dim}")
    if last != expect_last:
        raise ValueError(f"k_cache: last dim {last} does not match head_dim {head_dim} (expected {expect_last})")
    if bits is None:
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale: scales are only for int8/int4 caches; pass None for a float cache")
    else:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s is None:
                raise ValueError(f"{name}: required for an int{bits} cache")
            _tensor(name, s)
            if s.shape != (num_blocks, block_size, kv_heads):
                raise ValueError(f"{name}: expected shape {(num_blocks, block_size, kv_heads)}, got {tuple(s.shape)}")
            if s.dtype != torch.float32:
                raise ValueError(f"{name}: expected float32, got {s.dtype}")
            if s.device != device:
                raise ValueError(f"{name}: on {s.device}, expected {device}")
    return CacheInfo(bits, num_blocks, block_size, kv_heads, head_dim)


def check_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> CacheInfo:
    _tensor("q", q)
    if q.dim() != 3:
        raise ValueError(f"q: expected [seqs, heads, head_dim], got shape {tuple(q.shape)}")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q: dtype {q.dtype} is not fp32/fp16/bf16")
    seqs, heads, head_dim = q.shape
    info = check_cache(k_cache, v_cache, k_scale, v_scale, head_dim, q.device)
    if heads % info.kv_heads:
        raise ValueError(f"q: heads {heads} must be a multiple of kv_heads {info.kv_heads}")
    _tensor("block_tables", block_tables)
    if block_tables.dim() != 2 or block_tables.shape[0] != seqs:
        raise ValueError(f"block_tables: expected [{seqs}, max_blocks], got {tuple(block_tables.shape)}")
    if block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables: expected int32, got {block_tables.dtype}")
    _tensor("seq_lens", seq_lens)
    if seq_lens.shape != (seqs,):
        raise ValueError(f"seq_lens: expected shape ({seqs},), got {tuple(seq_lens.shape)}")
    if seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens: expected int32, got {seq_lens.dtype}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, expected {q.device} (same device as q)")
    return info


def check_seq_lens_values(seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> int:
    """Host-side value check (needs a device sync, so only done where it is cheap): returns max seq len."""
    if seq_lens.numel() == 0:
        return 0
    lo, hi = int(seq_lens.min()), int(seq_lens.max())
    capacity = block_tables.shape[1] * block_size
    if lo < 0:
        raise ValueError(f"seq_lens: must be >= 0, got {lo}")
    if hi > capacity:
        raise ValueError(f"seq_lens: {hi} exceeds block_tables capacity {block_tables.shape[1]} x {block_size}")
    return hi


def check_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> CacheInfo:
    _tensor("k", k)
    _tensor("v", v)
    if k.dim() != 3:
        raise ValueError(f"k: expected [tokens, kv_heads, head_dim], got shape {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} is not fp32/fp16/bf16")
    if v.device != k.device:
        raise ValueError(f"v: on {v.device}, expected {k.device}")
    tokens, kv_heads, head_dim = k.shape
    info = check_cache(k_cache, v_cache, k_scale, v_scale, head_dim, k.device, src="k")
    if kv_heads != info.kv_heads:
        raise ValueError(f"k: kv_heads {kv_heads} does not match k_cache kv_heads {info.kv_heads}")
    _tensor("slot_mapping", slot_mapping)
    if slot_mapping.shape != (tokens,):
        raise ValueError(f"slot_mapping: expected shape ({tokens},), got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping: expected int32 or int64, got {slot_mapping.dtype}")
    if slot_mapping.device != k.device:
        raise ValueError(f"slot_mapping: on {slot_mapping.device}, expected {k.device}")
    return info


def check_slot_values(slot_mapping: torch.Tensor, info: CacheInfo) -> None:
    """Host-side bound check on slots (sync; only where cheap)."""
    if slot_mapping.numel() and int(slot_mapping.max()) >= info.num_blocks * info.block_size:
        raise ValueError(
            f"slot_mapping: slot {int(slot_mapping.max())} >= cache capacity {info.num_blocks * info.block_size}"
        )
