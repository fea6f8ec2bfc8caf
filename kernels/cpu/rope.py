"""RoPE on q and k plus the KV cache write of one layer, through the native kernel (``rope.cpp``).

``rope_write(qkv, cos, sin, nh, nkv, k_cache, v_cache, slots)`` returns the rotated ``[n, nh + nkv, d]`` q and
k with the bits of attention.py's torch ops (``x * cos + roll(x, d/2) * sin_signed``) and stores the rotated k
and the untouched v at ``slots``, as ``PagedKVCache.write`` does for an fp32 layer. :func:`usable` says when
the kernel serves (fp32 CPU tensors, an fp32 cache layer); ``PDCLUSTER_NATIVE_ROPE=0`` turns it off alone.
"""

from __future__ import annotations

import torch

from pdcluster.kernels.cpu import native, step

ENV_SWITCH = "PDCLUSTER_NATIVE_ROPE"


def usable(qkv: torch.Tensor, cos: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (
        qkv.dtype == torch.float32 and cos.dtype == torch.float32 and k_cache.dtype == torch.float32
        and qkv.device.type == "cpu" and k_cache.device.type == "cpu" and qkv.is_contiguous()
        and cos.is_contiguous() and k_cache.is_contiguous()
        and not native.switched_off(ENV_SWITCH) and step.module() is not None
    )


def rope_write(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nh: int, nkv: int,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
) -> torch.Tensor:
    mod = step.module()
    assert mod is not None, "native rope kernel not available"
    out: torch.Tensor = mod.rope_write(qkv, cos, sin, nh, nkv, k_cache, v_cache, slots)
    return out
