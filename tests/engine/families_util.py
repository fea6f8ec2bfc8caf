"""Tiny random models of each supported family, written by transformers itself (the oracle's own format)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

BASE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=300,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=None,  # generate with min_new_tokens masks EOS; the engine (ignore_eos) does not
    tie_word_embeddings=False,
)

# model_type -> config overrides; windows of 8 tokens so 40-token prompts decode far past them
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": dict(model_type="qwen3"),
    "qwen3-sliding": dict(model_type="qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "gemma2": dict(
        model_type="gemma2",
        sliding_window=8,
        query_pre_attn_scalar=24,
        # small caps so the tanh is far from linear on these weights (real models: 50 and 30)
        attn_logit_softcapping=3.0,
        final_logit_softcapping=2.0,
        tie_word_embeddings=True,
    ),
    "gemma3": dict(
        model_type="gemma3_text",
        sliding_window=8,
        query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
        },
        final_logit_softcapping=None,
    ),
    "phi3": dict(model_type="phi3", sliding_window=8),
    "phi3-longrope": dict(
        model_type="phi3",
        max_position_embeddings=256,
        original_max_position_embeddings=64,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)],
        },
    ),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "mixtral-sliding": dict(
        model_type="mixtral", num_local_experts=3, num_experts_per_tok=2, sliding_window=8
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    ),
    "qwen3_moe-norm-topk": dict(
        model_type="qwen3_moe",
        num_experts=5,
        num_experts_per_tok=3,
        moe_intermediate_size=24,
        norm_topk_prob=True,
    ),
}


def build_family_model(folder: Path, family: str, seed: int = 0, shard: str | None = "40KB") -> Path:
    """Save a random model of ``family`` with transformers (sharded unless ``shard`` is None)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides = {**BASE, **FAMILIES[family]}
    model_type = overrides.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        # transformers' init (std 0.02, Gemma norms at zero) makes every layer nearly the identity; wider
        # random weights make each family switch (norm offsets, caps, routing) move the logits
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0.0, 0.05)
    model.save_pretrained(folder, max_shard_size=shard) if shard else model.save_pretrained(folder)
    return folder
