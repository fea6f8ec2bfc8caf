"""Triton split-K ("flash decoding") paged decode attention, with int8 / packed-int4 dequant fused.

Kernel 1 (grid seqs x kv_heads x partitions): one program owns all query heads that share a KV head (GQA: K/V
are loaded once per group) and one partition of the sequence. It walks the partition in tiles of TILE_N
tokens, mapping each token to its physical block through the block table, and keeps an online softmax
(running max m, running sum l, unnormalised acc). Kernel 2 (grid seqs x heads) merges the partitions:
``out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p``. When one partition covers every sequence the
first kernel normalises and writes the output itself and the reduce is skipped.

Quantized caches never materialise float K/V: int8/int4 codes go into the dot products and the per-token
scales are applied to the [group, TILE_N] score / probability tiles (one multiply per token, not per element).
int4 splits head_dim into even/odd halves (low/high nibbles) instead of interleaving them: the score is
``q_even . k_lo + q_odd . k_hi`` and the output keeps even/odd accumulators written back with stride 2.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from pdcluster.kernels.validate import CacheInfo, check_seq_lens_values

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    # fp32 caches keep IEEE fp32 products (TF32 would cost ~1e-3 relative error vs the reference).
    if DOT_FP32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _nibbles(b):
    """uint8 tile -> (low, high) sign-extended 4-bit codes as int32."""
    b = b.to(tl.int32)
    lo = b & 15
    hi = (b >> 4) & 15
    return lo - ((lo & 8) << 1), hi - ((hi & 8) << 1)


@triton.jit
def _paged_attn_partition_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr,
    out_ptr, pacc_ptr, pm_ptr, pl_ptr,
    qk_scale, max_blocks, num_blocks,
    s_qs, s_qh, s_qd,
    s_kb, s_kt, s_kh, s_kd,
    s_vb, s_vt, s_vh, s_vd,
    s_ksb, s_kst, s_ksh,
    s_vsb, s_vst, s_vsh,
    s_bts, s_btb,
    s_os, s_oh, s_od,
    num_parts, num_heads, part_len,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, BITS: tl.constexpr,
    DOT_FP32: tl.constexpr, ONE_PASS: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    # Clamp to the table's capacity so a bad seq_len can never read past block_tables.
    seq_len = tl.minimum(tl.load(lens_ptr + seq), max_blocks * BLOCK_SIZE)
    # part_len is a runtime value (not constexpr) so a growing context does not trigger recompiles.
    start = part * part_len
    end = tl.minimum(start + part_len, seq_len)

    g = tl.arange(0, GROUP_PAD)
    gmask = g < GROUP
    heads = kvh * GROUP + g
    q_row = q_ptr + seq * s_qs + heads * s_qh
    # Dot operand type: fp32 if q or the cache is fp32; else the float cache's dtype, or q's for codes
    # (int8 / int4 codes are exact in fp16 and bf16).
    if DOT_FP32:
        dot_ty = tl.float32
    elif BITS == 0:
        dot_ty = k_ptr.dtype.element_ty
    else:
        dot_ty = q_ptr.dtype.element_ty
    # head_dim is padded to a power of two (HEAD_PAD) for tl.arange / tl.dot; lanes past it are masked.
    HALF_PAD: tl.constexpr = HEAD_PAD // 2
    if BITS == 4:
        j = tl.arange(0, HALF_PAD)
        lane = j < HEAD_DIM // 2
        gl = gmask[:, None] & lane[None, :]
        q_e = tl.load(q_row[:, None] + (2 * j)[None, :] * s_qd, mask=gl, other=0.0)
        q_o = tl.load(q_row[:, None] + (2 * j + 1)[None, :] * s_qd, mask=gl, other=0.0)
        q_e = (q_e.to(tl.float32) * qk_scale).to(dot_ty)
        q_o = (q_o.to(tl.float32) * qk_scale).to(dot_ty)
        acc_e = tl.zeros([GROUP_PAD, HALF_PAD], dtype=tl.float32)
        acc_o = tl.zeros([GROUP_PAD, HALF_PAD], dtype=tl.float32)
    else:
        d = tl.arange(0, HEAD_PAD)
        lane = d < HEAD_DIM
        gl = gmask[:, None] & lane[None, :]
        q = tl.load(q_row[:, None] + d[None, :] * s_qd, mask=gl, other=0.0)
        q = (q.to(tl.float32) * qk_scale).to(dot_ty)
        acc = tl.zeros([GROUP_PAD, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)

    for t0 in range(start, end, TILE_N):
        t = t0 + tl.arange(0, TILE_N)
        tmask = t < end
        blk = tl.load(bt_ptr + seq * s_bts + (t // BLOCK_SIZE) * s_btb, mask=tmask, other=0).to(tl.int64)
        # A corrupt table entry reads a wrong block rather than faulting (table values are not host-checked).
        blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1)
        off = t % BLOCK_SIZE
        k_rows = k_ptr + blk * s_kb + off * s_kt + kvh * s_kh
        v_rows = v_ptr + blk * s_vb + off * s_vt + kvh * s_vh
        tl_mask = tmask[:, None] & lane[None, :]
        if BITS == 4:
            kb = tl.load(k_rows[:, None] + j[None, :] * s_kd, mask=tl_mask, other=0)
            k_lo, k_hi = _nibbles(kb)
            s = _dot(q_e, tl.trans(k_lo.to(dot_ty)), DOT_FP32) + _dot(q_o, tl.trans(k_hi.to(dot_ty)), DOT_FP32)
        else:
            k = tl.load(k_rows[:, None] + d[None, :] * s_kd, mask=tl_mask, other=0.0)
            s = _dot(q, tl.trans(k.to(dot_ty)), DOT_FP32)
        if BITS != 0:
            ks = tl.load(ks_ptr + blk * s_ksb + off * s_kst + kvh * s_ksh, mask=tmask, other=0.0)
            s = s * ks[None, :]
        s = tl.where(tmask[None, :], s, float("-inf"))
        # Each tile holds >= 1 valid token, so m_new is finite and exp2(-inf - m_new) = 0 on the first tile.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if BITS != 0:
            vs = tl.load(vs_ptr + blk * s_vsb + off * s_vst + kvh * s_vsh, mask=tmask, other=0.0)
            p = p * vs[None, :]
        p = p.to(dot_ty)
        if BITS == 4:
            vb = tl.load(v_rows[:, None] + j[None, :] * s_vd, mask=tl_mask, other=0)
            v_lo, v_hi = _nibbles(vb)
            acc_e = acc_e * alpha[:, None] + _dot(p, v_lo.to(dot_ty), DOT_FP32)
            acc_o = acc_o * alpha[:, None] + _dot(p, v_hi.to(dot_ty), DOT_FP32)
        else:
            v = tl.load(v_rows[:, None] + d[None, :] * s_vd, mask=tl_mask, other=0.0)
            acc = acc * alpha[:, None] + _dot(p, v.to(dot_ty), DOT_FP32)
        m_i = m_new

    if ONE_PASS:
        # seq_len 0 leaves l = 0: write zeros rather than 0/0.
        inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)
        o_row = out_ptr + seq * s_os + heads * s_oh
        o_ty = out_ptr.dtype.element_ty
        if BITS == 4:
            tl.store(o_row[:, None] + (2 * j)[None, :] * s_od, (acc_e * inv[:, None]).to(o_ty), mask=gl)
            tl.store(o_row[:, None] + (2 * j + 1)[None, :] * s_od, (acc_o * inv[:, None]).to(o_ty), mask=gl)
        else:
            tl.store(o_row[:, None] + d[None, :] * s_od, (acc * inv[:, None]).to(o_ty), mask=gl)
    else:
        # Partials are contiguous [seqs, heads, parts(, head_dim)] float32.
        pidx = (seq * num_heads + heads) * num_parts + part
        tl.store(pm_ptr + pidx, m_i, mask=gmask)
        tl.store(pl_ptr + pidx, l_i, mask=gmask)
        if BITS == 4:
            tl.store(pacc_ptr + pidx[:, None] * HEAD_DIM + (2 * j)[None, :], acc_e, mask=gl)
            tl.store(pacc_ptr + pidx[:, None] * HEAD_DIM + (2 * j + 1)[None, :], acc_o, mask=gl)
        else:
            tl.store(pacc_ptr + pidx[:, None] * HEAD_DIM + d[None, :], acc, mask=gl)


@triton.jit
def _paged_attn_reduce_kernel(
    out_ptr, pacc_ptr, pm_ptr, pl_ptr, lens_ptr,
    max_blocks, num_parts, num_heads, part_len,
    s_os, s_oh, s_od,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, PARTS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.minimum(tl.load(lens_ptr + seq), max_blocks * BLOCK_SIZE)
    used = tl.cdiv(seq_len, part_len)  # partitions holding >= 1 token; the rest were never meaningful
    p = tl.arange(0, PARTS_PAD)
    pmask = p < used
    base = (seq * num_heads + head) * num_parts
    m = tl.load(pm_ptr + base + p, mask=pmask, other=float("-inf"))
    l_p = tl.load(pl_ptr + base + p, mask=pmask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # seq_len 0: avoid -inf - -inf
    w = tl.where(pmask, tl.exp2(m - m_max), 0.0)
    denom = tl.sum(w * l_p, axis=0)
    d = tl.arange(0, HEAD_PAD)
    lane = d < HEAD_DIM
    acc = tl.load(pacc_ptr + (base + p)[:, None] * HEAD_DIM + d[None, :], mask=pmask[:, None] & lane[None, :],
                  other=0.0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + seq * s_os + head * s_oh + d * s_od, out.to(out_ptr.dtype.element_ty), mask=lane)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _default_partition(tokens_bound: int, programs: int, device: torch.device, tile_n: int) -> int:
    """Partition length in tokens: split only when (seqs x kv_heads) programs cannot fill the GPU."""
    if device.type != "cuda":
        return _pow2(tokens_bound)  # interpreter: one pass unless a test forces a split
    target = 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= target:
        return _pow2(tokens_bound)
    part = _pow2(-(-tokens_bound * programs // target))
    return max(part, 256, tile_n)


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    info: CacheInfo,
    scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    partition_size: int | None = None,
    tile_n: int | None = None,
) -> torch.Tensor:
    """Launcher (arguments already validated). ``partition_size`` / ``tile_n`` override the heuristics."""
    seqs, heads, head_dim = q.shape
    # Any head_dim (even for int4) and any block size: tiles run over tokens, and head_dim is padded to a
    # power of two >= the 16 lanes tl.dot needs (for int4, per nibble half).
    head_pad = max(32 if info.bits == 4 else 16, _pow2(head_dim))
    if q.device.type != "cuda":
        # Cheap on CPU; on CUDA it would cost a sync per call, so there the kernel clamps instead.
        check_seq_lens_values(seq_lens, block_tables, info.block_size)
    out = torch.empty((seqs, heads, head_dim), dtype=q.dtype, device=q.device)
    if seqs == 0:
        return out
    max_blocks = block_tables.shape[1]
    bound = max(max_blocks * info.block_size, 1)
    tile = tile_n or max(16, min(64, _pow2(bound)))
    group = heads // info.kv_heads
    part = partition_size or _default_partition(bound, seqs * info.kv_heads, q.device, tile)
    if part <= 0 or part % tile:
        raise ValueError(f"partition_size: must be a positive multiple of the tile ({tile}), got {part}")
    num_parts = -(-bound // part)
    one_pass = num_parts == 1
    dot_fp32 = q.dtype == torch.float32 or k_cache.dtype == torch.float32
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    ks = k_scale if k_scale is not None else seq_lens  # dummies never read for float caches
    vs = v_scale if v_scale is not None else seq_lens
    ks_strides = k_scale.stride() if k_scale is not None else (0, 0, 0)
    vs_strides = v_scale.stride() if v_scale is not None else (0, 0, 0)
    if one_pass:
        pacc = pm = pl = out  # unused
    else:
        pacc = torch.empty((seqs, heads, num_parts, head_dim), dtype=torch.float32, device=q.device)
        pm = torch.empty((seqs, heads, num_parts), dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
    _paged_attn_partition_kernel[(seqs, info.kv_heads, num_parts)](
        q, k_cache, v_cache, ks, vs, block_tables, seq_lens,
        out, pacc, pm, pl,
        float(scale) * LOG2E, max_blocks, info.num_blocks,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *ks_strides, *vs_strides,
        *block_tables.stride(), *out.stride(),
        num_parts, heads, part,
        GROUP=group, GROUP_PAD=max(16, _pow2(group)), HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        BLOCK_SIZE=info.block_size,
        TILE_N=tile, BITS=info.bits or 0, DOT_FP32=dot_fp32, ONE_PASS=one_pass,
        num_warps=4,
    )
    if not one_pass:
        _paged_attn_reduce_kernel[(seqs, heads)](
            out, pacc, pm, pl, seq_lens, max_blocks, num_parts, heads, part, *out.stride(),
            HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_SIZE=info.block_size, PARTS_PAD=max(2, _pow2(num_parts)),
            num_warps=4,
        )
    return out
