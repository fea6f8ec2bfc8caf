"""The collectives that make a rank's sliced model compute the whole model's result.

Installed on a model loaded from a ``local_config`` (shard.py), only when ``tp > 1``: the plain model's
forward is untouched. Row-parallel o_proj / down_proj outputs are summed across ranks (all_reduce), the
embedding becomes a masked lookup into this rank's vocabulary rows plus an all_reduce, and the LM head's
vocabulary slices are gathered (all_gather) and cut back to the real vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pdcluster.worker.engine.config import ModelConfig
from pdcluster.worker.engine.layers import MLP
from pdcluster.worker.engine.model import DecoderForCausalLM, DecoderLayer
from pdcluster.worker.engine.parallel import group


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + per)`` of the embedding; ids elsewhere contribute zeros before the sum."""

    def __init__(self, weight: torch.Tensor, start: int) -> None:
        super().__init__()
        self.weight = weight  # the same Parameter: a tied lm_head stays tied
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(inside, local, 0), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        dist.all_reduce(out, group=group.compute_group())
        return out


def _sum_partials(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(out, group=group.compute_group())
    return out


def _gather_vocab(vocab: int, tp: int) -> Any:
    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.contiguous()
        parts = [torch.empty_like(out) for _ in range(tp)]
        dist.all_gather(parts, out, group=group.compute_group())
        return torch.cat(parts, dim=-1)[..., :vocab]

    return hook


def install(model: DecoderForCausalLM, cfg: ModelConfig) -> None:
    """Wire ``model`` (a rank's slice, built from ``cfg = local_config(...)``) into the TP group."""
    full = cfg.tp_full
    if full is None or cfg.tp_size == 1:
        return
    embed = model.embed_tokens
    assert isinstance(embed, nn.Embedding)
    model.add_module("embed_tokens", VocabParallelEmbedding(embed.weight, cfg.tp_rank * cfg.vocab_size))
    model.lm_head.register_forward_hook(_gather_vocab(full.vocab_size, cfg.tp_size))
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        layer.self_attn.o_proj.register_forward_hook(_sum_partials)
        if isinstance(layer.mlp, MLP):  # MoE layers are replicated: their output is already whole
            layer.mlp.down_proj.register_forward_hook(_sum_partials)
