"""CPU fp32 projections on the native packed-weight kernel (kernels/cpu/linear.cpp), swapped in at load.

Why: a decode step is a chain of small-M products (M = the batch). MKL's GEMV streams the weights at 46-63 %
of the read bandwidth on this AMD EPYC, and its 16-row sgemm runs far below the core's AVX-512 FMA peak
(docs/benchmarks/engine.md at 5f904a5, fourth and fifth passes). The kernel streams 64-column panels packed once here.

What changes: every ``nn.Linear`` of the decoder (fused QKV, O, fused gate/up, down, LM head) becomes a
``PackedLinear`` holding only the packed panels; a tied input embedding becomes a ``PackedEmbedding`` that
reads its rows out of the LM head's panels, so the tied matrix stays one tensor in memory. Values are the
loaded ones: outputs equal ``F.linear``'s up to fp32 summation order (one accumulator per output, ascending
k). MoE experts and routers, half dtypes, CUDA and tensor-parallel ranks keep the torch path, and so does
every model when ``PDCLUSTER_NATIVE_KERNELS`` turns it off (``0``: all native kernels; ``-linear``: this one),
or the kernel cannot be built.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pdcluster.kernels import native

log = logging.getLogger("pdcluster.engine")

# Rows above which the product goes to MKL (batched GEMM on the panels) instead of the kernel. No crossover was
# found up to here: the kernel beat MKL at every row count measured, 1 to 1024 ("Fifth pass"), and shared over
# the step's pool 1.36x MKL on the panels at 2048 rows and 1.58x at 4096 (2026-12-02, "Sixth pass" in
# docs/benchmarks/engine.md at 5f904a5), so prefill chunks up to 4096 tokens take it; past that MKL (unmeasured).
MAX_KERNEL_ROWS = 4096


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with W kept only as 64-column panels ``wp [ceil(N/64), K, 64]``."""

    def __init__(self, wp: nn.Parameter, out_features: int, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.wp = wp
        self.bias = bias
        self.in_features, self.out_features = int(wp.shape[1]), out_features
        # Panels per shared item by row count (linear.grain), kept: a decode step calls each product with the
        # same few batch sizes, and the Python around a ~10-100 us kernel call is worth trimming
        self._grains: dict[int, int] = {}

    @property
    def weight(self) -> torch.Tensor:
        """The ``[N, K]`` weight, rebuilt from the panels (a copy: for inspection, not for the hot path)."""
        return native.unpack_linear(self.wp.data, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if x.dim() == 2 and x.dtype is torch.float32 and rows <= MAX_KERNEL_ROWS and x.stride(1) == 1:
            # the decoder's own calls: straight to the kernel (linear.linear, without its per-call checks)
            grain = self._grains.get(rows)
            if grain is None:
                grain = self._grains[rows] = native.linear_grain(rows, self.in_features, int(self.wp.shape[0]))
            mod = native.step_module()
            assert mod is not None  # a PackedLinear exists only where the kernel loaded
            y: torch.Tensor = mod.packed_linear(x, self.wp, self.out_features, self.bias, True, grain)
            return y
        x2 = x.reshape(-1, self.in_features)
        bias = None if self.bias is None else self.bias.data
        if x2.dtype == torch.float32 and x2.shape[0] <= MAX_KERNEL_ROWS:
            y = native.linear(x2, self.wp.data, self.out_features, bias)
        else:  # prefill: MKL's GEMM over the panels, [NB, M, 64] -> [M, N]
            y = native.mkl_packed(x2.to(self.wp.dtype), self.wp.data, self.out_features)
            if bias is not None:
                y = y + bias
        return y.reshape(*x.shape[:-1], self.out_features)


class PackedEmbedding(nn.Module):
    """An embedding table that is a tied LM head's panels: row i = ``wp[i // 64, :, i % 64]``."""

    def __init__(self, wp: nn.Parameter, num_embeddings: int) -> None:
        super().__init__()
        self.wp = wp
        self.num_embeddings, self.embedding_dim = num_embeddings, int(wp.shape[1])

    @property
    def weight(self) -> torch.Tensor:
        return native.unpack_linear(self.wp.data, self.num_embeddings)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # F.embedding's bounds check, kept: an id past the table must fail loudly, not read padding
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        return native.linear_rows(self.wp.data, ids.reshape(-1)).reshape(*ids.shape, self.embedding_dim)


def _pack(weight: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(native.pack_linear(weight.detach()), requires_grad=False)


def pack_linears(model: nn.Module) -> int:
    """Swap the decoder's fp32 CPU ``nn.Linear``s for ``PackedLinear`` in place (and a tied input embedding
    for a ``PackedEmbedding`` on the same panels); returns how many projections were swapped, 0 when the
    kernel is off or unavailable (the model is then untouched)."""
    candidates = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu"
        and not _is_router(parent, name)
    ]
    if not candidates or not native.linear_ready():
        return 0
    packed: dict[int, nn.Parameter] = {}
    for parent, name, lin in candidates:
        key = id(lin.weight)
        if key not in packed:
            packed[key] = _pack(lin.weight)
        setattr(parent, name, PackedLinear(packed[key], lin.out_features, lin.bias))
    embed = getattr(model, "embed_tokens", None)
    if type(embed) is nn.Embedding and id(embed.weight) in packed:  # tied: read rows from the LM head's panels
        model.embed_tokens = PackedEmbedding(packed[id(embed.weight)], embed.num_embeddings)
    log.info("CPU projections on the native packed kernel: %d swapped", len(candidates))
    return len(candidates)


def _is_router(parent: nn.Module, name: str) -> bool:
    # an MoE router's logits pick experts: keep transformers' exact MKL product there
    return name == "gate" and parent.__class__.__name__ == "SparseMoE"
