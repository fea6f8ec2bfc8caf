"""fp32 RMSNorm on the CPU through the native kernel (``norm.cpp``), optionally fused with the residual add.

``rms_norm(x, w, eps, residual)`` returns ``(y, s)``: ``s = x + residual`` (or None without one) and
``y = s * rsqrt(mean(s^2) + eps) * w``, or None when the kernel cannot take the call (not fp32 on the CPU,
native kernels off or unbuildable, ``PDCLUSTER_NATIVE_NORM=0``); the caller then runs its torch path.
"""

from __future__ import annotations

import torch

from pdcluster.kernels.cpu import native, step

ENV_SWITCH = "PDCLUSTER_NATIVE_NORM"


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    if (x.dtype != torch.float32 or w.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2
            or x.stride(-1) != 1 or (residual is not None and (residual.dtype != torch.float32
                                                                or residual.shape != x.shape
                                                                or residual.stride(-1) != 1))):
        return None
    if native.switched_off(ENV_SWITCH):
        return None
    mod = step.module()
    if mod is None:
        return None
    y, s = mod.rms_norm(x, w.contiguous(), float(eps), residual)
    return y, (s if residual is not None else None)
