"""A decode step of a dense Llama-style decoder as one native call (``kernels/cpu/decoder.cpp``).

The modules' decode path on fp32 CPU is already a chain of native kernels (packed products, add + RMSNorm,
RoPE + cache write, paged attention); what is left between them is Python: module calls, views, per-call
checks, about ten kernel calls a layer. The plan runs the same kernels in the same order with the same
arguments, so its bits are the modules' bits (tests/engine/test_fused_decode.py compares them exactly), and
the step keeps only the embedding lookup, the LM head and sampling in Python.

It serves a model whose every layer would take the native path anyway: fp32 on the CPU, packed projections,
RMSNorm (not Gemma's), no q/k norm, a dense gated SiLU MLP, RoPE on one table, the native attention reading a
float cache. Anything else (MoE, Gemma, quantized KV layers, a tensor-parallel rank, ``torch.compile``, the
kernels off) keeps the modules. ``PDCLUSTER_NATIVE_KERNELS=-decoder`` turns this alone off (read at every step,
as are ``-norm`` and ``-rope``, which turn it off too). The step runs without the GIL, so a server's event loop
streams the last step's tokens meanwhile.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

import torch

from pdcluster.kernels import native
from pdcluster.worker.engine.attention import AttnMetadata
from pdcluster.worker.engine.cpu_linear import PackedLinear
from pdcluster.worker.engine.kv_cache import PagedKVCache
from pdcluster.worker.engine.layers import MLP, RMSNorm

if TYPE_CHECKING:
    from pdcluster.worker.engine.model import DecoderForCausalLM, DecoderLayer

log = logging.getLogger("pdcluster.engine")


class FusedDecode:
    """One model's plan (over the cache it was built for: DecoderForCausalLM keys it by that cache):
    ``(embedded rows, cos, sin, metadata) -> final hidden states``."""

    def __init__(self, model: DecoderForCausalLM, plan: Any) -> None:
        self.plan = plan
        self.attns = [cast("DecoderLayer", layer).self_attn for layer in model.layers]
        first = cast("DecoderLayer", model.layers[0])
        mlp = cast(MLP, first.mlp)
        # (K, panels) of the four products of a layer: every layer has the same shapes (checked by build)
        self._shapes = [(int(p.wp.shape[1]), int(p.wp.shape[0])) for p in (cast(PackedLinear, q) for q in (
            first.self_attn.qkv_proj, first.self_attn.o_proj, mlp.gate_up_proj, mlp.down_proj))]
        self._grains: dict[int, list[int]] = {}  # row count -> panels per shared item of each product

    def usable(self, x: torch.Tensor, md: AttnMetadata) -> bool:
        """This step can take the plan: a pure decode step, fp32 rows, every switch still on."""
        return (not md.is_prefill and md.block_tables is not None and md.seq_lens is not None
                and x.dtype is torch.float32 and x.dim() == 2 and x.is_contiguous()
                and all(a.native_decode for a in self.attns)  # benchmarks turn layers' kernel off this way
                and native.enabled("decoder") and native.enabled("norm") and native.enabled("rope"))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, md: AttnMetadata) -> torch.Tensor:
        rows = int(x.shape[0])
        grains = self._grains.get(rows)
        if grains is None:
            grains = self._grains[rows] = [native.linear_grain(rows, k, nb) for k, nb in self._shapes]
        out: torch.Tensor = self.plan.forward_released(x, cos, sin, md.slot_mapping, md.block_tables,
                                                       md.seq_lens, grains, native.ATTENTION_PARALLEL_MIN)
        return out


def _why_not(model: DecoderForCausalLM, cache: PagedKVCache) -> str | None:
    """Why the modules must run this model's decode steps, or None when the plan can. The off switches are not
    reasons here: they are read at every step (FusedDecode.usable), so a plan built while one was set still
    serves once it is cleared."""
    from pdcluster.worker.engine.model import DecoderLayer

    if model.embed_scale is not None or any(model.local_rope):
        return "Gemma embeddings or a local RoPE table"
    if not _native_norm(model.norm):
        return "the final norm has no native kernel"
    shapes = None
    for i, layer in enumerate(model.layers):
        layer = cast(DecoderLayer, layer)
        attn, mlp = layer.self_attn, layer.mlp
        if layer.sandwich or type(mlp) is not MLP or mlp.act == "gelu_tanh":
            return f"layer {i}: not a dense SiLU MLP between pre-norms"
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(type(p) is PackedLinear for p in projections):
            return f"layer {i}: projections are not packed (native linear off, or not fp32 on the CPU)"
        if attn.q_norm is not None:
            return f"layer {i}: q/k norm"
        if not (_native_norm(layer.input_layernorm) and _native_norm(layer.post_attention_layernorm)):
            return f"layer {i}: a norm has no native kernel"
        if cache.is_quantized(i) or native.rope_kernel_for(cache.k[i], False) is None:
            return f"layer {i}: the cache is not an fp32 host cache the RoPE kernel writes"
        if not attn.uses_native_decode(cache):
            return f"layer {i}: the native attention does not read this cache"
        these = [tuple(cast(PackedLinear, p).wp.shape) for p in projections]
        if shapes is not None and these != shapes:
            return f"layer {i}: shapes differ from layer 0"
        shapes = these
    return None


def _native_norm(norm: RMSNorm) -> bool:
    return not norm.gemma and norm.weight.dtype == torch.float32 and native.norm_kernel_for(norm.weight, norm.eps) is not None


def build(model: DecoderForCausalLM, cache: PagedKVCache) -> FusedDecode | None:
    """The plan for this model and cache, or None (logged once, with the reason) where the modules run."""
    from pdcluster.worker.engine.model import DecoderLayer

    mod = native.step_module()
    reason = "the native kernels are off or not built" if mod is None else _why_not(model, cache)
    if reason is not None:
        log.info("decode steps through the modules (%s)", reason)
        return None
    layers = [cast(DecoderLayer, layer) for layer in model.layers]
    attn0 = layers[0].self_attn
    mlps = [cast(MLP, layer.mlp) for layer in layers]
    proj = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj) for layer in layers]

    def packed(p: Any) -> torch.Tensor:
        return cast(PackedLinear, p).wp.data

    def bias(p: Any) -> torch.Tensor | None:
        b = cast(PackedLinear, p).bias
        return None if b is None else b.data

    assert mod is not None
    plan = mod.DecodePlan(
        attn0.num_heads, attn0.num_kv_heads, attn0.head_dim, mlps[0].inter, float(attn0.scale),
        float(attn0.softcap or 0.0),
        [layer.input_layernorm.weight.data for layer in layers],
        [layer.post_attention_layernorm.weight.data for layer in layers],
        [float(layer.input_layernorm.eps) for layer in layers],
        [float(layer.post_attention_layernorm.eps) for layer in layers],
        [packed(q) for q, _ in proj], [bias(q) for q, _ in proj],
        [packed(o) for _, o in proj], [bias(o) for _, o in proj],
        [packed(m.gate_up_proj) for m in mlps], [packed(m.down_proj) for m in mlps],
        [int(layer.self_attn.window or 0) for layer in layers],
        list(cache.k), list(cache.v), model.norm.weight.data, float(model.norm.eps),
    )
    log.info("decode steps as one native call (%d layers)", len(layers))
    return FusedDecode(model, plan)
