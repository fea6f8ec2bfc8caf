"""int8 per-vector KV (de)quantization on the CPU through the native AVX-512 kernel (``quant.cpp``).

Bit for bit ``pdcluster.kernels.kv_quant``'s ``quantize_kv(x, bits=8)`` and ``dequantize_kv(q, s, 8, float32)``,
in one pass per vector instead of torch's several over full-size temporaries: what int8 compression of a
float layer costs on the KV wire, at both ends. Callers keep their torch path wherever :func:`ready` is False
(no AVX-512 or compiler, ``PDCLUSTER_NATIVE_KERNELS`` turning it off) or the tensors are not contiguous
fp32/int8 on the CPU.
"""

from __future__ import annotations

from types import ModuleType

import torch

from pdcluster.kernels.cpu import native

NAME = "pdc_quant"
SOURCES = ["quant.cpp"]


def module() -> ModuleType | None:
    return native.load(NAME, SOURCES)


def ready() -> bool:
    """The kernel runs here now (the switch lets it, and it built)."""
    return native.enabled("quant") and module() is not None


def quantize8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 codes shaped like ``x``, float32 scales ``x.shape[:-1]``), or None when the kernel cannot take ``x``."""
    mod = module() if native.enabled("quant") else None
    if mod is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() < 1 or not x.shape[-1]:
        return None
    codes, scales = mod.quantize8(x.contiguous())
    return codes, scales


def dequantize8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """float32 ``q * scale`` per vector, or None when the kernel cannot take these tensors."""
    mod = module() if native.enabled("quant") else None
    if (mod is None or q.device.type != "cpu" or q.dtype != torch.int8 or scales.device.type != "cpu"
            or q.dim() < 1 or tuple(scales.shape) != tuple(q.shape[:-1])):
        return None
    out: torch.Tensor = mod.dequantize8(q.contiguous(), scales.to(torch.float32).contiguous())
    return out


def dequantize(q: torch.Tensor, scales: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """``kv_quant.dequantize_kv`` (same values), through the kernel when it can take the call."""
    from pdcluster.kernels.kv_quant import dequantize_kv

    if bits == 8 and dtype == torch.float32:
        out = dequantize8(q, scales)
        if out is not None:
            return out
    return dequantize_kv(q, scales, bits, dtype)
