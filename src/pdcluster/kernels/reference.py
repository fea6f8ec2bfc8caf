"""Torch paths: the CPU serving path and the fallback everywhere Triton is not used.

Vectorized over the batch (no Python loop per sequence) so a CPU decode step stays cheap: gather each
sequence's blocks into a padded ``[seqs, max_len, kv_heads, head_dim]`` tensor, mask past ``seq_lens``, and
do GQA by viewing q as ``[seqs, kv_heads, group, head_dim]`` so KV heads are never copied per query head.
Quantized caches dequantize only the gathered blocks. Math is float32 whatever the storage dtype.
"""

from __future__ import annotations

import math

import torch

from pdcluster.kernels.kv_quant import dequantize_kv, quantize_kv
from pdcluster.kernels.validate import CacheInfo, check_seq_lens_values, check_slot_values


def _gather(cache: torch.Tensor, scale: torch.Tensor | None, bt: torch.Tensor, info: CacheInfo) -> torch.Tensor:
    """Blocks ``bt [seqs, nblk]`` of a cache -> float32 ``[seqs, kv_heads, nblk * block_size, head_dim]``."""
    seqs, nblk = bt.shape
    shape = (seqs, info.kv_heads, nblk * info.block_size, info.head_dim)
    # index_select of whole blocks is the fastest gather on CPU (one contiguous row copy per block; 2x faster
    # than a per-element advanced index straight into the target layout). The relayout to heads-major
    # [seqs, kv_heads, L, d], which makes both matmuls plain batched GEMMs over (seq, kv_head), then rides
    # on the float32 widening / dequant copy we need anyway.
    blocks = cache.index_select(0, bt.flatten()).view(seqs, nblk, *cache.shape[1:]).permute(0, 3, 1, 2, 4)
    if info.bits is None:
        out = torch.empty(blocks.shape, dtype=torch.float32, device=cache.device)
        return out.copy_(blocks).view(shape)
    assert scale is not None
    s = scale.index_select(0, bt.flatten()).view(seqs, nblk, *scale.shape[1:]).permute(0, 3, 1, 2)
    codes = blocks.contiguous()  # 1-byte codes: cheap to relayout before widening
    return dequantize_kv(codes, s, bits=info.bits, dtype=torch.float32).reshape(shape)


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
