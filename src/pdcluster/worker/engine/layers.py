"""Per-token building blocks of the decoder: RMSNorm (Llama and Gemma flavours), the gated MLP, and the
mixture-of-experts MLP with transformers' routing (softmax in fp32, top-k, optional renormalization)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.kernels import native
from pdcluster.worker.engine.families import MoeSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, gemma: bool = False) -> None:
        super().__init__()
        # Gemma stores w and scales by (1 + w) (its checkpoints hold zeros for identity); the rest scale by w
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))
        self.eps = eps
        self.gemma = gemma
        # The native kernel's entry point (kernels/native.py), decided at the first call (the weights are
        # loaded by then); False: torch's ops. A call per norm is ~2 us instead of ~15-40 us of torch ops.
        self._native: Callable[..., tuple[torch.Tensor, torch.Tensor]] | bool | None = None

    def _kernel(self, x: torch.Tensor) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
        k = self._native
        if k is None:
            k = self._native = (not self.gemma and native.norm_kernel_for(self.weight, self.eps)) or False
        if (k is False or x.dtype is not torch.float32 or x.dim() != 2 or not x.is_cpu or not x.is_contiguous()
                or not native.enabled("norm")):
            return None
        assert callable(k)
        return k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self._kernel(x)
        return self._torch(x) if k is None else k(x, None, self.weight, self.eps)[1]

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, norm(x + delta))``: the residual add and the next norm in one native call where the
        kernel serves (fp32 CPU, not Gemma), the same bits as the two torch ops otherwise."""
        k = self._kernel(x)
        if k is not None and delta.is_contiguous() and delta.shape == x.shape:
            return k(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self._torch(x)

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemma:
            # transformers' Gemma norm: everything in fp32, (1 + w) applied before the cast back
            out = F.rms_norm(x.float(), self.weight.shape, None, self.eps) * (1.0 + self.weight.float())
            return out.type_as(x)
        # One fused op; bit-identical to transformers' pow/mean/rsqrt/mul sequence in fp32, and, like it,
        # normalizes half inputs in fp32 before the weight multiply in the model dtype.
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    return F.silu(x)


class MLP(nn.Module):
    """Gated MLP with gate and up fused into one matmul (one big GEMM beats two small ones on CPU)."""

    def __init__(self, hidden: int, inter: int, act: str) -> None:
        super().__init__()
        self.inter, self.act = inter, act
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(activation(self.act, gate) * up)


class SparseMoE(nn.Module):
    """Top-k routed experts. ``w13[e]`` is expert e's gate rows then up rows, ``w2[e]`` its down projection."""

    def __init__(self, hidden: int, spec: MoeSpec, act: str) -> None:
        super().__init__()
        self.spec, self.act, self.inter = spec, act, spec.intermediate_size
        self.gate = nn.Linear(hidden, spec.num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(spec.num_experts, 2 * spec.intermediate_size, hidden))
        self.w2 = nn.Parameter(torch.empty(spec.num_experts, hidden, spec.intermediate_size))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [n, k], expert ids [n, k]) exactly as transformers' routers compute them."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.spec.weights_in_fp32:
            weights = weights.to(logits.dtype)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        # Each expert runs once over the tokens routed to it; experts and tokens are visited in transformers'
        # order (expert ascending, then top-k slot, then token) so fp32 sums accumulate the same way.
        by_slot = experts.t()  # [k, n]
        for e in torch.unique(experts).tolist():
            slot, tok = torch.where(by_slot == e)
            gate, up = F.linear(x[tok], self.w13[e]).split(self.inter, dim=-1)
            h = F.linear(activation(self.act, gate) * up, self.w2[e]) * weights[tok, slot, None]
            out.index_add_(0, tok, h.to(out.dtype))
        return out
