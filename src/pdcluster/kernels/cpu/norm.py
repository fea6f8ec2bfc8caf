"""RMSNorm, optionally fused with the residual add before it, through the native kernel (``norm.cpp``).

The kernel's ``add_rms_norm(x, delta, weight, eps)`` returns ``(x + delta, F.rms_norm(x + delta, ..., weight,
eps))`` (``(x, ...)`` without delta) with exactly torch's fp32 bits, so greedy tokens stay identical to
transformers'. It repeats the summation order of torch's CPU sum, which depends on the torch build and CPU
capability: :func:`trusted` compares it with ``F.rms_norm`` on random rows once per hidden size and eps, and
:func:`kernel_for` hands it out only where that check passed. ``PDCLUSTER_NATIVE_KERNELS=-norm`` turns it off
alone.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdcluster.kernels.cpu import step

log = logging.getLogger("pdcluster.engine")


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


def kernel_for(weight: torch.Tensor, eps: float) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """The kernel's ``add_rms_norm(x, delta, weight, eps)`` for a norm with this weight and eps, or None where
    torch must run it (an fp16/bf16 or CUDA weight, a width whose bits the check refused, no build). Decided
    once per norm; each call still needs a contiguous fp32 CPU ``x`` of shape ``[rows, H]`` (and ``delta``
    alike, or None) and the switch still on (``native.enabled("norm")``)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 1:
        return None
    if not trusted(int(weight.numel()), float(eps)):
        return None
    mod = step.module()
    return None if mod is None else mod.add_rms_norm
