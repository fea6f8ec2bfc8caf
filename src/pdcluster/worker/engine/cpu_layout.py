"""Weights laid out for CPU decode: every projection stored column-major (the transpose is contiguous).

A batch-1 decode step is a chain of matrix-vector products that stream every weight once. ``F.linear(x, W)``
with a row-major ``W [out, in]`` is MKL's transposed sgemv (a dot product per output row); with ``W``'s
transpose contiguous it is the plain sgemv (axpy-like sweeps down contiguous columns), which streams the
same bytes 1.6-1.85x faster on this AMD EPYC (all 33 matrices of the 56M benchmark model, 1 and 2 threads,
docs/benchmarks/engine.md at 5f904a5). From 16 rows up MKL packs either layout and gives identical bits at the same
speed, so prefill and batched decode neither gain nor lose.

Only the memory layout changes: shapes, names, tied parameters (the same Parameter object) and the math
stay as loaded, so nothing outside the forward notices. On CUDA cuBLAS takes both layouts alike: untouched.
"""

from __future__ import annotations

import torch
from torch import nn

from pdcluster.worker.engine.layers import SparseMoE


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the same shape and values, its last two dimensions stored transposed."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def column_major_linears(model: nn.Module) -> int:
    """Re-store every Linear weight (and the MoE experts' stacked weights) column-major in place; returns
    how many tensors moved. Parameters keep their identity, so a tied lm_head / embedding stays tied (its
    embedding lookup then reads a strided row: ``hidden`` elements per token, negligible next to a step)."""
    targets: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear):
            targets[id(module.weight)] = module.weight
        elif isinstance(module, SparseMoE):
            targets[id(module.w13)], targets[id(module.w2)] = module.w13, module.w2
    with torch.no_grad():
        for p in targets.values():
            p.data = _column_major(p.data)
    return len(targets)
