"""Triton write of new tokens' K/V into the paged cache, quantizing on the fly for int8 / int4 caches.

Grid (tokens, kv_heads): one program writes the K and the V vector of one (token, kv head). A negative slot is padding: the
program masks every store instead of returning early, so no branch depends on loaded data. The quantizer is
bit-for-bit the torch one (kv_quant.quantize_kv): same fp32 absmax / qmax, IEEE division (div_rn), and
round-half-to-even via the 1.5 * 2**23 trick, so either backend can fill a cache the other reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdcluster.kernels.kv_quant import ROUND_MAGIC
from pdcluster.kernels.validate import CacheInfo, check_slot_values

ROUND_MAGIC_C = tl.constexpr(ROUND_MAGIC)


@triton.jit
def _codes(x, safe, qmax):
    """x / scale rounded half-to-even and clamped to [-qmax, qmax], as fp32."""
    y = tl.math.div_rn(x, tl.zeros_like(x) + safe)
    r = (y + ROUND_MAGIC_C) - ROUND_MAGIC_C
    return tl.minimum(tl.maximum(r, -qmax), qmax)


@triton.jit
def _write_vector(src, s_d, dst, c_d, sc, valid, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                  BITS: tl.constexpr):
    """Write one [HEAD_DIM] vector at ``src`` into the cache row ``dst`` (and its scale at ``sc``)."""
    # Masks as index < limit (limit 0 for padding slots): plain comparisons the interpreter accepts too.
    n_ok = tl.where(valid, HEAD_DIM, 0)
    # Lanes past HEAD_DIM (padding to a power of two) load 0, which leaves absmax unchanged.
    if BITS == 0:
        d = tl.arange(0, HEAD_PAD)
        x = tl.load(src + d * s_d, mask=d < HEAD_DIM, other=0.0)
        tl.store(dst + d * c_d, x.to(dst.dtype.element_ty), mask=d < n_ok)
    elif BITS == 8:
        d = tl.arange(0, HEAD_PAD)
        x = tl.load(src + d * s_d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        scale = tl.math.div_rn(tl.max(tl.abs(x), axis=0), 127.0)
        codes = _codes(x, tl.where(scale > 0, scale, 1.0), 127.0)
        tl.store(dst + d * c_d, codes.to(tl.int8), mask=d < n_ok)
        tl.store(sc, scale, mask=valid)
    else:
        # Even / odd halves become the low / high nibbles of one byte; the scale spans both.
        j = tl.arange(0, HEAD_PAD // 2)
        xe = tl.load(src + (2 * j) * s_d, mask=j < HEAD_DIM // 2, other=0.0).to(tl.float32)
        xo = tl.load(src + (2 * j + 1) * s_d, mask=j < HEAD_DIM // 2, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(xe), axis=0), tl.max(tl.abs(xo), axis=0))
        scale = tl.math.div_rn(amax, 7.0)
        safe = tl.where(scale > 0, scale, 1.0)
        ce = _codes(xe, safe, 7.0).to(tl.int32)
        co = _codes(xo, safe, 7.0).to(tl.int32)
        byte = (ce & 15) | ((co & 15) << 4)
        tl.store(dst + j * c_d, byte.to(tl.uint8), mask=j < n_ok // 2)
        tl.store(sc, scale, mask=valid)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,
    s_kt, s_kh, s_kd,
    s_vt, s_vh, s_vd,
    s_kcb, s_kct, s_kch, s_kcd,
    s_vcb, s_vct, s_vch, s_vcd,
    s_ksb, s_kst, s_ksh,
    s_vsb, s_vst, s_vsh,
    num_slots,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BITS: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    # Out-of-range slots are checked on the host only on CPU (a sync on CUDA); here they are skipped like
    # padding, so a bad slot can never write outside the cache.
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    _write_vector(k_ptr + tok * s_kt + head * s_kh, s_kd, kc_ptr + blk * s_kcb + off * s_kct + head * s_kch,
                  s_kcd, ks_ptr + blk * s_ksb + off * s_kst + head * s_ksh, valid, HEAD_DIM, HEAD_PAD, BITS)
    _write_vector(v_ptr + tok * s_vt + head * s_vh, s_vd, vc_ptr + blk * s_vcb + off * s_vct + head * s_vch,
                  s_vcd, vs_ptr + blk * s_vsb + off * s_vst + head * s_vsh, valid, HEAD_DIM, HEAD_PAD, BITS)


def write_kv_cache_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    info: CacheInfo,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Launcher (arguments already validated)."""
    tokens, kv_heads, head_dim = k.shape
    if k.device.type != "cuda":
        check_slot_values(slot_mapping, info)  # a sync on CUDA; there the caller owns slot validity
    if tokens == 0:
        return
    ks = k_scale if k_scale is not None else k_cache
    vs = v_scale if v_scale is not None else v_cache
    ks_strides = k_scale.stride() if k_scale is not None else (0, 0, 0)
    vs_strides = v_scale.stride() if v_scale is not None else (0, 0, 0)
    _write_kv_kernel[(tokens, kv_heads)](
        k, v, k_cache, v_cache, ks, vs, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(), *ks_strides, *vs_strides,
        info.num_blocks * info.block_size,
        HEAD_DIM=head_dim, HEAD_PAD=max(2, 1 << (head_dim - 1).bit_length()), BLOCK_SIZE=info.block_size,
        BITS=info.bits or 0,
        num_warps=1,
    )
