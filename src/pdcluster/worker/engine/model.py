"""The decoder (Llama 2/3, Mistral, Qwen2/3, Gemma 2/3 text, Phi-3, Mixtral, Qwen3-MoE) on the paged KV cache.

The batch is flat: ``[num_tokens, hidden]`` with no padding. A step is either a prefill step (each
sequence contributes a chunk of new tokens, which attend to the sequence's cached prefix and causally to
each other) or a decode step (one token per sequence, attending through the block table). The math follows
transformers' modeling code for each family operation by operation so fp32 logits match it closely; q/k/v
and gate/up are fused into one matmul each. Family switches are read in families.py; attention lives in
attention.py, norms and MLPs in layers.py.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from pdcluster.worker.engine import fused_decode
from pdcluster.worker.engine.attention import Attention, AttnMetadata, PrefillSeq
from pdcluster.worker.engine.config import ModelConfig
from pdcluster.worker.engine.fused_decode import FusedDecode
from pdcluster.worker.engine.greedy_head import GreedyHead
from pdcluster.worker.engine.kv_cache import PagedKVCache
from pdcluster.worker.engine.layers import MLP, RMSNorm, SparseMoE
from pdcluster.worker.engine.rope import RopeSpec

__all__ = ["AttnMetadata", "DecoderForCausalLM", "LlamaForCausalLM", "PrefillSeq"]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        gemma = cfg.family.gemma
        self.self_attn = Attention(cfg, layer)
        moe = cfg.moe is not None and cfg.moe.layers[layer]
        self.mlp: nn.Module = (
            SparseMoE(cfg.hidden_size, cfg.moe, cfg.hidden_act)
            if moe and cfg.moe is not None
            else MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma)
        # Llama: post_attention_layernorm is the pre-MLP norm. Gemma: it normalizes the attention output
        # (sandwich), and pre/post_feedforward_layernorm wrap the MLP.
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma)
        self.sandwich = gemma
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        md: AttnMetadata,
        cache: PagedKVCache,
        delta: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(residual, delta)``: the layer's output is ``residual + delta``. The last add is left to the next
        norm, which fuses it with its own (RMSNorm.add_forward); ``delta`` is the previous layer's."""
        if self.sandwich:
            if delta is not None:
                x = x + delta
            x = x + self.post_attention_layernorm(
                self.self_attn(self.input_layernorm(x), cos, sin, md, cache)
            )
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), None
        if delta is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_forward(x, delta)
        x, h = self.post_attention_layernorm.add_forward(x, self.self_attn(h, cos, sin, md, cache))
        return x, self.mlp(h)


class DecoderForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # Gemma scales embeddings by sqrt(hidden), rounded to the weights' dtype as transformers does
        self.embed_scale = cfg.hidden_size**0.5 if cfg.family.gemma else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.family.gemma)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # which layers use the local (sliding-window) RoPE table
        self.local_rope = [
            cfg.local_rope is not None and cfg.window_of(i) is not None for i in range(cfg.num_layers)
        ]
        # cos/sin for every position, computed once in fp32 like transformers, then cast to the model dtype
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        self.register_buffer("cos_sin_local", torch.empty(0), persistent=False)
        # The decode step as one native call (fused_decode.py): built at the first decode step for the cache
        # it sees, None where the modules must run
        self._fused: tuple[PagedKVCache, FusedDecode | None] | None = None
        self._greedy: GreedyHead | None = None  # build_greedy_head, once the head is packed

    @property
    def needs_full_gather(self) -> bool:
        """Some layer decodes by gathering the whole sequence by slot (see Attention)."""
        # ModuleList is typed as holding any Module; __init__ fills it with DecoderLayers only
        return any(cast(DecoderLayer, layer).self_attn.gathers_whole_sequence for layer in self.layers)

    def decode_gathers(self, cache: PagedKVCache) -> bool:
        """Some layer decodes without the native kernel, so a decode step needs the gather (and window) slots;
        with the kernel everywhere the per-step metadata is only the block tables and lengths."""
        return not all(cast(DecoderLayer, layer).self_attn.uses_native_decode(cache) for layer in self.layers)

    def init_rope(self, max_len: int) -> None:
        self.cos_sin = self._rope_table(self.cfg.rope, max_len)
        if self.cfg.local_rope is not None:
            self.cos_sin_local = self._rope_table(self.cfg.local_rope, max_len)

    def _rope_table(self, rope: RopeSpec, max_len: int) -> torch.Tensor:
        pos = torch.arange(max_len, dtype=torch.float32)
        freqs = pos[:, None] * rope.inv_freq(self.cfg.head_dim, self.cfg.max_position_embeddings)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * rope.attention_factor, emb.sin() * rope.attention_factor
        half = sin.shape[-1] // 2
        sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # see Attention.forward
        dtype, device = self.embed_tokens.weight.dtype, self.embed_tokens.weight.device
        return torch.stack((cos, sin_signed)).to(device=device, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, md: AttnMetadata, cache: PagedKVCache) -> torch.Tensor:
        """Hidden states after the final norm, ``[num_tokens, hidden]``."""
        cs = self.cos_sin[:, md.positions].unsqueeze(2)  # [2, n, 1, d]: broadcast over heads
        x = self.embed_tokens(input_ids)
        fused = None if md.is_prefill else self._fused_for(cache)
        if fused is not None and fused.usable(x, md):
            return fused(x, cs[0], cs[1], md)
        local = self.cos_sin_local[:, md.positions].unsqueeze(2) if self.cos_sin_local.numel() else cs
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        delta: torch.Tensor | None = None
        for layer, use_local in zip(self.layers, self.local_rope, strict=True):
            c = local if use_local else cs
            x, delta = layer(x, c[0], c[1], md, cache, delta)
        return self.norm(x) if delta is None else self.norm.add_forward(x, delta)[1]

    def _fused_for(self, cache: PagedKVCache) -> FusedDecode | None:
        if self._fused is None or self._fused[0] is not cache:
            if torch.compiler.is_compiling():  # a compiled decode step traces the modules
                return None
            self._fused = (cache, fused_decode.build(self, cache))
        return self._fused[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.cfg.final_logit_softcapping
        if cap is not None:  # in the model dtype, as transformers does before generate's fp32 cast
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def build_greedy_head(self) -> GreedyHead:
        """Make the bf16 screen of the LM head (greedy_head.py) now, once the weights are in place: its
        memory is then taken before the KV cache is sized, and a bad setting fails at start, not in a step."""
        self._greedy = GreedyHead(self.lm_head, self.cfg.final_logit_softcapping, self.compute_logits)
        return self._greedy

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """``argmax(compute_logits(hidden))`` per row (int64), through the bf16 screen where it runs."""
        return (self._greedy or self.build_greedy_head()).tokens(hidden)


# The name the rest of the engine has always imported
LlamaForCausalLM = DecoderForCausalLM
