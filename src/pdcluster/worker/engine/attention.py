"""Attention over the paged KV cache: per-step metadata, and one layer's attention with the family options
(q/k RMSNorm per head, a sliding window, tanh soft-capping of the scores, a custom score scale).

Prefill attends with SDPA (a banded mask for sliding-window layers) or, with soft-capping, with the same
matmul / tanh / softmax sequence as transformers' eager attention. Decode on the CPU goes through the native
AVX-512 kernel (``pdcluster.kernels.native``: reads K/V through the block table, takes the window and
the soft-cap) wherever it builds and reads the layer's cache format. Otherwise decode goes through the paged
kernel when it can; the kernels in ``pdcluster.kernels`` take neither a window nor a soft-cap, so those
layers gather their keys and values by slot instead: a sliding-window layer gathers only the last ``window``
positions of each sequence (built once per step by :func:`window_slots`), which both honours the window
exactly and bounds the gather's size, and a soft-capped global layer gathers the whole sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pdcluster.kernels import dequantize_kv, native, paged_decode_attention
from pdcluster.worker.engine.config import ModelConfig
from pdcluster.worker.engine.kv_cache import PagedKVCache
from pdcluster.worker.engine.layers import RMSNorm


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
    # Decode by gathering (CPU float caches, soft-capped layers): slots of every position of every sequence
    # [seqs, max_len] and its mask [seqs, 1, 1, max_len], built once per step and shared by those layers
    gather_slots: torch.Tensor | None = None
    gather_mask: torch.Tensor | None = None
    # The same mask as SDPA's additive bias (0 / -inf in the model dtype), built once per step instead of
    # converted from the boolean mask in every layer; None when every row is full length (nothing to mask)
    gather_bias: torch.Tensor | None = None
    # Decode of sliding-window layers: slots of the last `window` positions [seqs, <=window] and their mask
    window_slots: torch.Tensor | None = None
    window_mask: torch.Tensor | None = None
    # A mixed step: the first num_decode tokens are decode rows (the decode fields above describe them),
    # the rest are the prefill chunks
    num_decode: int = 0


def window_slots(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, window: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots a decode query may see under a sliding window, and which of them are real.

    The query sits at position ``len - 1`` and, as in transformers (``kv_idx > q_idx - window``), sees
    positions ``len - window .. len - 1``. Rows shorter than the widest one are padded with their last slot
    and masked out.
    """
    lens = seq_lens.long()
    span = min(window, int(lens.max()))
    pos = (lens - window).clamp(min=0)[:, None] + torch.arange(span, device=lens.device)
    valid = pos < lens[:, None]
    pos = torch.minimum(pos, (lens - 1).clamp(min=0)[:, None])
    slots = block_tables.long().gather(1, pos // block_size) * block_size + pos % block_size
    return slots, valid[:, None, None, :]


def gather_kv(cache: PagedKVCache, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V at ``slots`` ``[seqs, L]`` as ``[seqs, L, kv_heads, head_dim]`` in the model dtype."""
    kvh, d, bits = cache.kv_heads, cache.head_dim, cache.layer_bits[layer]
    # index_select over the flattened slots: a row copy per slot, ~40 % cheaper than advanced indexing
    # (`x[slots]`) for the same bits (docs/benchmarks/engine.md at 5f904a5)
    flat = slots.reshape(-1)
    out = []
    for codes, scale in ((cache.k[layer], cache.k_scale[layer]), (cache.v[layer], cache.v_scale[layer])):
        x = codes.view(-1, kvh, codes.shape[-1]).index_select(0, flat)
        if bits is not None:
            assert scale is not None
            x = dequantize_kv(x, scale.view(-1, kvh).index_select(0, flat), bits, cache.dtype)
        out.append(x.view(*slots.shape, kvh, d))
    return out[0], out[1]


def eager_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """transformers' eager attention with soft-capping: q ``[..., heads, Lq, d]``, k/v ``[..., kv_heads, Lk, d]``,
    boolean mask broadcastable to ``[..., heads, Lq, Lk]`` (True = attend)."""
    *lead, heads, lq, d = q.shape
    kvh = k.shape[-3]
    qg = q.reshape(*lead, kvh, heads // kvh, lq, d)
    scores = torch.matmul(qg, k.unsqueeze(-3).transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.reshape(*lead, heads, lq, -1).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    probs = probs.reshape(*lead, kvh, heads // kvh, lq, -1)
    return torch.matmul(probs, v.unsqueeze(-3)).reshape(*lead, heads, lq, d)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.attn_scale
        self.window = cfg.window_of(layer)
        self.softcap = cfg.attn_logit_softcapping
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = self.k_norm = None
        if cfg.family.qk_norm:  # Qwen3, Gemma 3: RMSNorm over each head's q and k, before RoPE
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.family.gemma)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.family.gemma)
        # Decode through the native CPU kernel: None = decide at the first decode (it needs the cache's
        # format); benchmarks set False to measure the torch path in the same process
        self.native_decode: bool | None = None
        # RoPE + cache write through the native kernel (kernels/cpu/rope.py): decided at the first forward
        self._rope: Callable[..., torch.Tensor] | bool | None = None

    @property
    def gathers_whole_sequence(self) -> bool:
        """Decode needs every position gathered by slot (the kernel cannot soft-cap)."""
        return self.softcap is not None and self.window is None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, md: AttnMetadata, cache: PagedKVCache
    ) -> torch.Tensor:
        n, nh = x.shape[0], self.num_heads
        h = nh + self.num_kv_heads
        qkv = self.qkv_proj(x).view(n, h + self.num_kv_heads, self.head_dim)
        rope = self._rope_kernel(qkv, cos, cache)
        if rope is not None:  # the rotation and the cache write below in one native pass (same bits)
            kc, vc = cache.k[self.layer], cache.v[self.layer]
            qk = rope(qkv, cos, sin, nh, self.num_kv_heads, kc, vc, md.slot_mapping)
            q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, h:]
        else:
            qk = qkv[:, :h]
            if self.q_norm is not None and self.k_norm is not None:
                qk = torch.cat((self.q_norm(qk[:, :nh]), self.k_norm(qk[:, nh:])), 1)
            # RoPE on q and k together. transformers computes x*cos + cat(-x2, x1)*sin; rolling by half a head
            # and folding the sign into sin (sin_signed = cat(-sin, sin)) gives the same bits in fewer ops.
            qk = qk * cos + qk.roll(self.head_dim // 2, -1) * sin
            q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, h:]
            cache.write(self.layer, k, v, md.slot_mapping)
        if md.is_prefill:
            if md.layer_hook is not None:
                md.layer_hook(self.layer)
            nd = md.num_decode
            out = self._prefill(q[nd:], k[nd:], v[nd:], md, cache)
            if nd:  # a mixed step: the decode rows attend over the cache, after this step's writes
                out = torch.cat((self._decode(q[:nd], md, cache), out), 0)
        else:
            out = self._decode(q, md, cache)
        return self.o_proj(out.reshape(n, self.q_size))

    def _rope_kernel(
        self, qkv: torch.Tensor, cos: torch.Tensor, cache: PagedKVCache
    ) -> Callable[..., torch.Tensor] | None:
        k = self._rope
        if k is None:
            k = self._rope = (self.q_norm is None and native.rope_kernel_for(
                cache.k[self.layer], cache.is_quantized(self.layer))) or False
        if (k is False or qkv.dtype is not torch.float32 or cos.dtype is not torch.float32 or not qkv.is_cpu
                or not qkv.is_contiguous() or not cos.is_contiguous() or not native.enabled("rope")):
            return None
        assert callable(k)
        return k

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttnMetadata, cache: PagedKVCache
    ) -> torch.Tensor:
        outs = []
        offset = 0
        for s in md.prefill:
            qs = q[offset : offset + s.length].transpose(0, 1)  # [heads, len, d]
            ks, vs = k[offset : offset + s.length], v[offset : offset + s.length]
            first = 0  # position of the first key
            if s.start > 0:
                # Fresh (un-quantized) K/V for the new tokens, the cached prefix read back from the cache
                assert s.block_ids is not None
                pk, pv = cache.read(self.layer, s.block_ids, s.start)
                if self.window is not None:  # keys before the first query's window are never seen
                    first = max(0, s.start - self.window + 1)
                ks, vs = torch.cat((pk[first:], ks), 0), torch.cat((pv[first:], vs), 0)
            o = self._attend(qs, ks.transpose(0, 1), vs.transpose(0, 1), s.start - first)
            outs.append(o.transpose(0, 1))
            offset += s.length
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
        """Causal (and windowed) attention of queries at key positions ``q_start ..`` of ``k``."""
        if self.window is None and self.softcap is None and q_start == 0:
            # a prompt from scratch sees exactly what a monolithic HF forward sees
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        qpos = torch.arange(q_start, q_start + q.shape[1], device=q.device)[:, None]
        kpos = torch.arange(k.shape[1], device=q.device)[None, :]
        mask = kpos <= qpos
        if self.window is not None:
            mask &= kpos > qpos - self.window
        if self.softcap is not None:
            return eager_attention(q, k, v, mask, self.scale, self.softcap)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)

    def uses_native_decode(self, cache: PagedKVCache) -> bool:
        """Decode goes through the native CPU kernel (decided at the first ask: it needs the cache's format)."""
        if self.native_decode is None:
            self.native_decode = native.attention_available(cache.k[self.layer], self.head_dim)
        return self.native_decode

    def _decode(self, q: torch.Tensor, md: AttnMetadata, cache: PagedKVCache) -> torch.Tensor:
        if self.uses_native_decode(cache) and md.block_tables is not None and md.seq_lens is not None:
            return native.paged_decode_attention(
                q, cache.k[self.layer], cache.v[self.layer], md.block_tables, md.seq_lens, scale=self.scale,
                k_scale=cache.k_scale[self.layer], v_scale=cache.v_scale[self.layer], window=self.window,
                softcap=self.softcap,
            )
        bias: torch.Tensor | None = None
        if self.window is not None:
            slots, mask = md.window_slots, md.window_mask
            bias = mask
        elif self.softcap is not None or (md.gather_slots is not None and not cache.is_quantized(self.layer)):
            # CPU, float cache: the kernel API is per layer and stateless, so it re-derives positions from
            # the block table and validates its inputs in every layer; here the slot indices were built once
            # per step, and each layer is one gather per K/V plus one fused SDPA (about 1/3 of the ops).
            slots, mask = md.gather_slots, md.gather_mask
            bias = md.gather_bias
        else:
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
        assert slots is not None and mask is not None, (
            "decode metadata lacks the gather slots this layer needs"
        )
        b, d = q.shape[0], self.head_dim
        k, v = gather_kv(cache, self.layer, slots)  # [seqs, L, kv_heads, d]
        qb, kb, vb = q.view(b, self.num_heads, 1, d), k.transpose(1, 2), v.transpose(1, 2)
        if self.softcap is not None:
            o = eager_attention(qb, kb, vb, mask, self.scale, self.softcap)
        else:
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=bias, scale=self.scale, enable_gqa=True)
        return o.view(b, self.num_heads, d)
