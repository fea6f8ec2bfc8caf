"""What differs between the decoder families we run, read from config.json the way transformers reads it.

Every family is the same pre-norm decoder (RoPE, GQA, gated MLP) with a few switches: q/k RMSNorm per head
(Qwen3, Gemma 3), Gemma's (1 + w) norms, sandwich norms, scaled embeddings and soft-capping, sliding-window
layers, a fused checkpoint layout (Phi-3), and mixture-of-experts MLPs (Mixtral, Qwen3-MoE). Defaults here
are transformers' config defaults, used only when config.json leaves a field out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    qk_norm: bool = False
    gemma: bool = False  # (1 + w) RMSNorm in fp32, sandwich norms, sqrt(hidden) embedding scale, gelu-tanh
    qkv_bias_default: bool = False
    o_proj_bias: bool = True  # whether attention_bias also covers o_proj
    tie_default: bool = False
    moe: str | None = None  # "mixtral" | "qwen3_moe"
    fused_checkpoint: bool = False  # the checkpoint already holds qkv_proj / gate_up_proj (Phi-3)
    windows: str = "none"  # how sliding-window layers are chosen, see layer_windows()
    default_theta: float = 10000.0


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(windows="all"),
    "qwen2": Family(qkv_bias_default=True, o_proj_bias=False, windows="qwen"),
    "qwen3": Family(qk_norm=True, windows="qwen"),
    "gemma2": Family(gemma=True, tie_default=True, windows="alternate"),
    "gemma3_text": Family(gemma=True, qk_norm=True, tie_default=True, windows="alternate"),
    "phi3": Family(fused_checkpoint=True, windows="all"),
    "mixtral": Family(moe="mixtral", windows="all", default_theta=1e6),
    "qwen3_moe": Family(qk_norm=True, moe="qwen3_moe", windows="all"),
}

# Options that change the math in ways we do not implement; each is rejected by name at load.
_REJECT_IF_TRUE = ("mlp_bias", "use_bidirectional_attention", "use_qk_norm_per_layer")


def check_unsupported(raw: dict[str, Any], where: str) -> None:
    for key in _REJECT_IF_TRUE:
        if raw.get(key):
            raise ValueError(f"{where}: {key}=true is not supported")
    if raw.get("model_type") == "phi3" and raw.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias=true is not supported for phi3")


def layer_types(raw: dict[str, Any], fam: Family, num_layers: int, where: str) -> list[str]:
    """'sliding_attention' or 'full_attention' per layer, as the transformers config computes them."""
    window = raw.get("sliding_window")
    if fam.windows == "qwen":
        # Qwen2/3: windows only with use_sliding_window, then on layers >= max_window_layers
        if not raw.get("use_sliding_window") or not window:
            return ["full_attention"] * num_layers
        given = raw.get("layer_types")
        if given is None:
            first = int(raw.get("max_window_layers", 28))
            given = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    elif fam.windows == "alternate":
        given = raw.get("layer_types")
        if given is None:
            # Gemma 2: every other layer from the first; Gemma 3: five local then one global
            pattern = 2 if raw.get("model_type") == "gemma2" else int(raw.get("sliding_window_pattern", 6))
            given = [
                "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
            ]
    elif fam.windows == "all" and window:
        # Mistral, Mixtral, Phi-3, Qwen3-MoE: transformers applies sliding_window to every layer
        given = ["sliding_attention"] * num_layers
    else:
        given = ["full_attention"] * num_layers
    if len(given) != num_layers or not set(given) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"{where}: layer_types must list sliding_attention/full_attention for each layer")
    if "sliding_attention" in given and not window:
        raise ValueError(f"{where}: layer_types has sliding_attention layers but sliding_window is not set")
    return list(given)


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    # Mixtral keeps the routing weights in fp32; Qwen3-MoE casts them back to the activations' dtype
    weights_in_fp32: bool
    layers: tuple[bool, ...]  # which layers are sparse (the rest use the dense MLP)


def read_moe(raw: dict[str, Any], fam: Family, num_layers: int, where: str) -> MoeSpec | None:
    if fam.moe is None:
        return None
    experts = raw.get("num_local_experts") or raw.get("num_experts")
    top_k = raw.get("num_experts_per_tok")
    if not experts or not top_k:
        raise ValueError(f"{where}: num_local_experts / num_experts_per_tok are required for {fam.moe}")
    experts, top_k = int(experts), int(top_k)
    if not 0 < top_k <= experts:
        raise ValueError(f"{where}: num_experts_per_tok={top_k} must be in 1..{experts}")
    if fam.moe == "mixtral":
        return MoeSpec(experts, top_k, int(raw["intermediate_size"]), True, True, (True,) * num_layers)
    if raw.get("moe_intermediate_size") is None:
        raise ValueError(f"{where}: required field 'moe_intermediate_size' is missing")
    dense = set(raw.get("mlp_only_layers") or [])
    step = int(raw.get("decoder_sparse_step", 1))
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return MoeSpec(
        experts,
        top_k,
        int(raw["moe_intermediate_size"]),
        bool(raw.get("norm_topk_prob", False)),
        False,
        layers,
    )
