"""Greedy argmax over fp32 logits rows on the CPU through the native kernel (``argmax.cpp``).

``argmax(x)`` is ``x.argmax(-1)`` (first maximum; a NaN is the maximum) for a 2-D fp32 CPU tensor, by the
kernel where it is built and by torch everywhere else (``PDCLUSTER_NATIVE_KERNELS=-argmax`` forces torch).
"""

from __future__ import annotations

import torch

from pdcluster.kernels.cpu import native, step


def argmax(x: torch.Tensor) -> torch.Tensor:
    if (x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[1] > 0
            and x.stride(-1) == 1 and native.enabled("argmax")):
        mod = step.module()
        if mod is not None:
            out: torch.Tensor = mod.argmax_rows(x)
            return out
    return x.argmax(-1)
