"""RMSNorm, optionally fused with the residual add before it, through the native kernel (``norm.cpp``).

``add_rms_norm(x, delta, weight, eps)`` returns ``(x + delta, F.rms_norm(x + delta, ..., weight, eps))`` with
exactly torch's fp32 bits, so greedy tokens stay identical to transformers'. The kernel repeats the summation
order of torch's CPU sum, which depends on the torch build and CPU capability: :func:`trusted` compares it with
``F.rms_norm`` on random rows once per hidden size and eps, and callers use torch wherever it says no.
``PDCLUSTER_NATIVE_NORM=0`` turns this kernel off alone.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from pdcluster.kernels.cpu import native, step

log = logging.getLogger("pdcluster.engine")
ENV_SWITCH = "PDCLUSTER_NATIVE_NORM"


@functools.cache
def trusted(hidden: int, eps: float) -> bool:
    """The kernel builds here and gives F.rms_norm's bits for rows of this width (checked once, on rows of
    several scales, ragged batch sizes included)."""
    mod = step.module()
    if mod is None or hidden < 1:
        return False
    g = torch.Generator().manual_seed(hidden)
    for rows, scale in ((1, 1.0), (7, 1e-3), (64, 30.0), (33, 1e3)):
        x = torch.randn(rows, hidden, generator=g) * scale
        d = torch.randn(rows, hidden, generator=g) * scale
        w = torch.randn(hidden, generator=g)
        s, y = mod.add_rms_norm(x, d, w, eps)
        ref_s = x + d
        if not (torch.equal(s, ref_s) and torch.equal(y, F.rms_norm(ref_s, (hidden,), w, eps))):
            log.warning("native RMSNorm differs from torch's bits at hidden size %d here; using torch's", hidden)
            return False
    return True


def usable(x: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
    """Whether ``x`` (``[..., H]``) and this norm can take the kernel now."""
    return (
        x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
        and x.dim() >= 1 and x.shape[-1] == weight.numel() and x.is_contiguous()
        and not native.switched_off(ENV_SWITCH) and trusted(int(weight.numel()), float(eps))
    )


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, rms_norm(x + delta) * weight)`` by the kernel (the caller checked :func:`usable`; ``delta``
    must be contiguous and of ``x``'s shape); without ``delta``, ``(x, rms_norm(x) * weight)``."""
    mod = step.module()
    assert mod is not None, "native norm kernel not available"
    h = x.shape[-1]
    s, y = mod.add_rms_norm(x.view(-1, h), None if delta is None else delta.reshape(-1, h), weight, eps)
    return s.view(x.shape), y.view(x.shape)
