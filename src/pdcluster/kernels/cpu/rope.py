"""RoPE on q and k plus the KV cache write of one layer, through the native kernel (``rope.cpp``).

The kernel's ``rope_write(qkv, cos, sin, nh, nkv, k_cache, v_cache, slots)`` returns the rotated
``[n, nh + nkv, d]`` q and k with the bits of attention.py's torch ops
(``x * cos + roll(x, d/2) * sin_signed``) and stores the rotated k and the untouched v at ``slots``, as
``PagedKVCache.write`` does for an fp32 layer.
:func:`kernel_for` says whether it serves a cache layer (fp32 CPU); ``PDCLUSTER_NATIVE_KERNELS=-rope`` turns
it off alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdcluster.kernels.cpu import step


def kernel_for(k_cache: torch.Tensor, quantized: bool) -> Callable[..., torch.Tensor] | None:
    """The kernel's ``rope_write`` for a cache layer it can write (fp32, CPU, contiguous, not quantized), or
    None (torch's ops and ``PagedKVCache.write``). Decided once per layer; each call still needs contiguous
    fp32 CPU ``qkv`` and ``cos``/``sin`` and the switch still on (``native.enabled("rope")``)."""
    on_cpu = k_cache.device.type == "cpu" and k_cache.is_contiguous()
    if quantized or k_cache.dtype != torch.float32 or not on_cpu:
        return None
    mod = step.module()
    return None if mod is None else mod.rope_write
