"""Llama-family decoder (Llama 2/3, Mistral, Qwen2-style qkv bias) running on the paged KV cache.

The batch is flat: ``[num_tokens, hidden]`` with no padding. A step is either a prefill step (each
sequence contributes a chunk of new tokens, which attend to the sequence's cached prefix and causally to
each other) or a decode step (one token per sequence, attending through the block table). The math follows
transformers' LlamaForCausalLM operation by operation so fp32 logits match it closely; q/k/v and gate/up
are fused into one matmul each because one big GEMM beats two or three small ones on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from pdcluster.kernels import paged_decode_attention
from pdcluster.worker.engine.config import ModelConfig
from pdcluster.worker.engine.kv_cache import PagedKVCache
from torch import nn


@dataclass
class PrefillSeq:
    """One sequence's chunk in a prefill step: tokens [start, start + length) are new."""

    start: int  # tokens already in the cache (prefix-cache hit or earlier chunks)
    length: int
    block_ids: torch.Tensor | None  # int64 block table, only needed when start > 0


@dataclass
class AttnMetadata:
    is_prefill: bool
    positions: torch.Tensor  # int64 [num_tokens]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    prefill: list[PrefillSeq] = field(default_factory=list)
    block_tables: torch.Tensor | None = None  # int32 [seqs, max_blocks] (decode)
    seq_lens: torch.Tensor | None = None  # int32 [seqs] (decode, including the new token)
    # called after layer i's KV is in the cache (prefill only): lets KV stream out while later layers run
    layer_hook: Callable[[int], None] | None = None
    # CPU float caches (decode): slots of every position of every sequence [seqs, max_len] and its mask
    # [seqs, 1, 1, max_len], built once per step and shared by all float layers (see Attention._decode)
    gather_slots: torch.Tensor | None = None
    gather_mask: torch.Tensor | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op; bit-identical to transformers' pow/mean/rsqrt/mul sequence in fp32, and, like it,
        # normalizes half inputs in fp32 before the weight multiply in the model dtype.
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, md: AttnMetadata, cache: PagedKVCache
    ) -> torch.Tensor:
        n, h = x.shape[0], self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(x).view(n, h + self.num_kv_heads, self.head_dim)
        # RoPE on q and k together. transformers computes x*cos + cat(-x2, x1)*sin; rolling by half a head
        # and folding the sign into sin (sin_signed = cat(-sin, sin)) gives the same bits in fewer ops.
        qk = qkv[:, :h]
        qk = qk * cos + qk.roll(self.head_dim // 2, -1) * sin
        q, k, v = qk[:, : self.num_heads], qk[:, self.num_heads :], qkv[:, h:]
        cache.write(self.layer, k, v, md.slot_mapping)
        if md.is_prefill:
            if md.layer_hook is not None:
                md.layer_hook(self.layer)
            out = self._prefill(q, k, v, md, cache)
        else:
            out = self._decode(q, md, cache)
        return self.o_proj(out.reshape(n, self.q_size))

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttnMetadata, cache: PagedKVCache
    ) -> torch.Tensor:
        outs = []
        offset = 0
        for s in md.prefill:
            qs = q[offset : offset + s.length].transpose(0, 1)  # [heads, len, d]
            ks, vs = k[offset : offset + s.length], v[offset : offset + s.length]
            if s.start == 0:
                # Fresh (un-quantized) K/V: a prompt sees exactly what a monolithic HF forward sees.
                o = F.scaled_dot_product_attention(
                    qs,
                    ks.transpose(0, 1),
                    vs.transpose(0, 1),
                    is_causal=True,
                    scale=self.scale,
                    enable_gqa=True,
                )
            else:
                assert s.block_ids is not None
                pk, pv = cache.read(self.layer, s.block_ids, s.start)
                kk = torch.cat((pk, ks), 0).transpose(0, 1)
                vv = torch.cat((pv, vs), 0).transpose(0, 1)
                # causal with the query block aligned to the end of the keys
                mask = torch.ones(s.length, s.start + s.length, dtype=torch.bool, device=q.device).tril(
                    s.start
                )
                o = F.scaled_dot_product_attention(
                    qs, kk, vv, attn_mask=mask, scale=self.scale, enable_gqa=True
                )
            outs.append(o.transpose(0, 1))
            offset += s.length
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)

    def _decode(self, q: torch.Tensor, md: AttnMetadata, cache: PagedKVCache) -> torch.Tensor:
        # gather_slots exist when any layer is float; quantized layers of a mixed-precision cache still go
        # through the kernel, which dequantizes with this layer's scales.
        if md.gather_slots is not None and not cache.is_quantized(self.layer):
            # CPU, float cache: the kernel API is per layer and stateless, so it re-derives positions from
            # the block table and validates its inputs in every layer; here the slot indices were built once
            # per step, and each layer is one gather per K/V plus one fused SDPA (about 1/3 of the ops).
            b, kvh, d = q.shape[0], self.num_kv_heads, self.head_dim
            k = cache.k[self.layer].view(-1, kvh, d)[md.gather_slots]  # [seqs, max_len, kv_heads, d]
            v = cache.v[self.layer].view(-1, kvh, d)[md.gather_slots]
            o = F.scaled_dot_product_attention(
                q.view(b, self.num_heads, 1, d),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=md.gather_mask,
                scale=self.scale,
                enable_gqa=True,
            )
            return o.view(b, self.num_heads, d)
        assert md.block_tables is not None and md.seq_lens is not None
        return paged_decode_attention(
            q,
            cache.k[self.layer],
            cache.v[self.layer],
            md.block_tables,
            md.seq_lens,
            scale=self.scale,
            k_scale=cache.k_scale[self.layer],
            v_scale=cache.v_scale[self.layer],
        )


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, md: AttnMetadata, cache: PagedKVCache
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, md, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # cos/sin for every position, computed once in fp32 like transformers, then cast to the model dtype
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)

    def init_rope(self, max_len: int) -> None:
        pos = torch.arange(max_len, dtype=torch.float32)
        freqs = pos[:, None] * self.cfg.inv_freq()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype, device = self.embed_tokens.weight.dtype, self.embed_tokens.weight.device
        sin = emb.sin()
        half = sin.shape[-1] // 2
        sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # see Attention.forward
        self.cos_sin = torch.stack((emb.cos(), sin_signed)).to(device=device, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, md: AttnMetadata, cache: PagedKVCache) -> torch.Tensor:
        """Hidden states after the final norm, ``[num_tokens, hidden]``."""
        cs = self.cos_sin[:, md.positions].unsqueeze(2)  # [2, n, 1, d]: broadcast over heads
        cos, sin = cs[0], cs[1]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, md, cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
