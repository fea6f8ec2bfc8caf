"""How each weight is sliced for one tensor-parallel rank at load time (Megatron's layout).

A rank's model is the ordinary decoder built from :func:`local_config`: the same code with fewer heads, a
narrower MLP and a slice of the vocabulary, so attention, the fused q/k/v and gate/up matmuls and the paged
cache need no TP branches. :func:`slice_weight` cuts each checkpoint tensor to that rank's part:

- q/k/v (and their biases): column-parallel by head; KV heads follow ``heads.kv_heads_of_rank`` (split when
  ``kv_heads >= tp``, one replicated head per rank otherwise), so each rank's q heads find their KV group.
- gate/up: column-parallel by intermediate row; o_proj and down_proj: row-parallel (their input columns),
  their partial outputs summed by an all_reduce (collectives.py). o_proj's bias lives on rank 0 only.
- embed_tokens / lm_head: vocab-parallel rows, the vocabulary padded up to a multiple of ``tp`` with zero rows.
- MoE experts and their router stay replicated (every rank computes the whole sparse MLP): simpler, exact, and
  the dense layers carry the TP speed-up; sharding experts is left for later.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from pdcluster.worker.engine.config import ModelConfig
from pdcluster.worker.engine.parallel.heads import check_layout, kv_heads_of_rank

_DENSE_MLP = re.compile(r"^layers\.\d+\.mlp\.(gate_proj|up_proj|gate_up_proj|down_proj)\.weight$")
_ATTN = re.compile(r"^layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|qkv_proj|o_proj)\.(weight|bias)$")


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """ValueError naming the head or MLP count ``tp`` does not fit."""
    check_layout(cfg.num_kv_heads, cfg.num_heads, tp)
    dense = cfg.moe is None or not all(cfg.moe.layers)
    if dense and cfg.intermediate_size % tp:
        raise ValueError(f"tensor parallel size {tp} must divide the MLP intermediate size {cfg.intermediate_size}")


def vocab_per_rank(vocab: int, tp: int) -> int:
    return -(-vocab // tp)


def local_config(cfg: ModelConfig, tp: int, rank: int) -> ModelConfig:
    """The config of rank ``rank``'s slice: its model and its paged cache are built from this."""
    check_tp(cfg, tp)
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // tp,
        num_kv_heads=len(kv_heads_of_rank(cfg.num_kv_heads, tp, rank)),
        intermediate_size=cfg.intermediate_size // tp,
        vocab_size=vocab_per_rank(cfg.vocab_size, tp),
        tp_rank=rank,
        tp_size=tp,
        tp_full=cfg,
    )


def _rows(t: torch.Tensor, start: int, length: int) -> torch.Tensor:
    return t.narrow(0, start, length)


def _vocab_rows(t: torch.Tensor, vocab: int, tp: int, rank: int) -> torch.Tensor:
    per = vocab_per_rank(vocab, tp)
    start = rank * per
    part = t[start : min(start + per, vocab)]
    if part.shape[0] == per:
        return part
    pad = torch.zeros(per - part.shape[0], *t.shape[1:], dtype=t.dtype)  # never looked up, logits cut off
    return torch.cat((part, pad))


def _qkv_parts(full: ModelConfig, tp: int, rank: int) -> list[tuple[int, int]]:
    """(start, length) rows of q, k and v inside the full fused q/k/v tensor that this rank keeps."""
    d = full.head_dim
    q_per = full.num_heads // tp
    kv = kv_heads_of_rank(full.num_kv_heads, tp, rank)
    q, k = full.num_heads * d, full.num_kv_heads * d
    return [(rank * q_per * d, q_per * d), (q + kv.start * d, len(kv) * d), (q + k + kv.start * d, len(kv) * d)]


def slice_weight(name: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """This rank's part of checkpoint tensor ``name`` (HF name without ``model.``); ``cfg`` is local_config's."""
    full, tp, rank = cfg.tp_full, cfg.tp_size, cfg.tp_rank
    if full is None or tp == 1:
        return t
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return _vocab_rows(t, full.vocab_size, tp, rank)
    m = _ATTN.match(name)
    if m is not None:
        proj, kind = m.groups()
        d = full.head_dim
        q_per = full.num_heads // tp
        kv = kv_heads_of_rank(full.num_kv_heads, tp, rank)
        if proj == "q_proj":
            return _rows(t, rank * q_per * d, q_per * d)
        if proj in ("k_proj", "v_proj"):
            return _rows(t, kv.start * d, len(kv) * d)
        if proj == "qkv_proj":  # fused checkpoint (Phi-3): slice q, k and v each, keep them fused
            return torch.cat([_rows(t, s, n) for s, n in _qkv_parts(full, tp, rank)])
        if kind == "bias":  # o_proj: row-parallel, so its bias must be added once, after the sum
            return t if rank == 0 else torch.zeros_like(t)
        return t[:, rank * q_per * d : (rank + 1) * q_per * d]
    m = _DENSE_MLP.match(name)
    if m is not None:
        inter = full.intermediate_size
        per = inter // tp
        if m.group(1) == "down_proj":
            return t[:, rank * per : (rank + 1) * per]
        if m.group(1) == "gate_up_proj":  # fused checkpoint: gate rows then up rows
            return torch.cat((_rows(t, rank * per, per), _rows(t, inter + rank * per, per)))
        return _rows(t, rank * per, per)
    return t  # norms, MoE router and experts: replicated
