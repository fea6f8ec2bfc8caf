"""Torch paths: the CPU serving path and the fallback everywhere Triton is not used.

Vectorized over the batch (no Python loop per sequence) so a CPU decode step stays cheap: gather each
sequence's blocks into a padded ``[seqs, max_len, kv_heads, head_dim]`` tensor, mask past ``seq_lens``, and
do GQA by viewing q as ``[seqs, kv_heads, group, head_dim]`` so KV heads are never copied per query head.
Quantized caches dequantize only the gathered blocks. Math is float32 whatever the storage dtype.
"""

from __future__ import annotations

import math

import torch

from .kv_quant import dequantize_kv, quantize_kv
from .validate import CacheInfo, check_seq_lens_values, check_slot_values


def _gather(cache: torch.Tensor, scale: torch.Tensor | None, bt: torch.Tensor, info: CacheInfo) -> torch.Tensor:
    """Blocks ``bt [seqs, nblk]`` of a cache -> float32 ``[seqs, kv_heads, nblk * block_size, head_dim]``."""
    seqs, nblk = bt.shape
    length = nblk * info.block_size
    # One advanced-index gather straight into heads-major [seqs, kv_heads, L, d], so both matmuls below are
    # plain batched GEMMs over (seq, kv_head) and no relayout copy is needed.
    blk = bt.unsqueeze(-1).expand(seqs, nblk, info.block_size).reshape(seqs, 1, length)
    off = torch.arange(length, device=bt.device).remainder_(info.block_size).view(1, 1, length)
    head = torch.arange(info.kv_heads, device=bt.device).view(1, info.kv_heads, 1)
    x = cache[blk, off, head]
    if info.bits is None:
        return x.to(torch.float32)
    assert scale is not None
    return dequantize_kv(x, scale[blk, off, head], bits=info.bits, dtype=torch.float32)


def paged_decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    info: CacheInfo,
    scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    seqs, heads, head_dim = q.shape
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    max_len = check_seq_lens_values(seq_lens, block_tables, info.block_size)
    if max_len == 0:
        return torch.zeros_like(q)
    nblk = -(-max_len // info.block_size)
    # Table entries past a sequence's end may be padding (-1, stale ids): clamp so the gather is in bounds;
    # those positions are masked out below.
    bt = block_tables[:, :nblk].long().clamp(0, info.num_blocks - 1)
    k = _gather(k_cache, k_scale, bt, info)  # [seqs, kv_heads, L, d]
    v = _gather(v_cache, v_scale, bt, info)
    group = heads // info.kv_heads
    qg = q.to(torch.float32).reshape(seqs, info.kv_heads, group, head_dim) * scale
    scores = torch.matmul(qg, k.transpose(-1, -2))  # [seqs, kv_heads, group, L]
    pos = torch.arange(k.shape[2], device=q.device)
    valid = pos.unsqueeze(0) < seq_lens.unsqueeze(1).to(torch.int64)  # [seqs, L]
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v).reshape(seqs, heads, head_dim)
    # seq_len 0 (padding rows) would be 0/0: defined as zeros.
    out = torch.where((seq_lens > 0)[:, None, None], out, torch.zeros((), device=q.device))
    return out.to(q.dtype)


def write_kv_cache_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    info: CacheInfo,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    check_slot_values(slot_mapping, info)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if slots.numel() == 0:
        return
    # (block, offset) advanced indexing writes through any cache strides (a flat view would need contiguity).
    blk, off = slots // info.block_size, slots % info.block_size
    for new, cache, scale in ((k[keep], k_cache, k_scale), (v[keep], v_cache, v_scale)):
        if info.bits is None:
            cache[blk, off] = new.to(cache.dtype)
        else:
            assert scale is not None
            codes, s = quantize_kv(new, bits=info.bits)
            cache[blk, off] = codes
            scale[blk, off] = s
