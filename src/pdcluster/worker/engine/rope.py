"""RoPE parameters read from config.json, and their inverse frequencies bit-for-bit as transformers computes them.

Two config shapes exist: transformers-5 ``rope_parameters`` (optionally one dict per layer type, as Gemma 3
writes it) and the older ``rope_theta`` + ``rope_scaling``. Both are folded into one :class:`RopeSpec`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
_NEEDED = {
    "linear": ["factor"],
    "llama3": ["factor", "low_freq_factor", "high_freq_factor"],
    "longrope": ["short_factor", "long_factor", "original_max_position_embeddings"],
}


@dataclass(frozen=True)
class RopeSpec:
    rope_type: str
    theta: float
    params: dict[str, Any] = field(default_factory=dict)
    # transformers multiplies cos/sin by this ("attention_scaling"); only longrope sets it != 1
    attention_factor: float = 1.0

    def inv_freq(self, head_dim: int, max_position_embeddings: int) -> torch.Tensor:
        dim = head_dim
        shape = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
        p = self.params
        if self.rope_type == "longrope":
            # Only the short factors are ever used: load_model refuses a max length past
            # original_max_position_embeddings, where transformers would switch factors mid-sequence.
            ext = torch.tensor(p["short_factor"], dtype=torch.float32)
            return 1.0 / (ext * self.theta**shape)
        inv = 1.0 / (self.theta**shape)
        if self.rope_type == "linear":
            return inv / p["factor"]
        if self.rope_type == "llama3":
            factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
            old = p.get("original_max_position_embeddings") or max_position_embeddings
            lo_wavelen, hi_wavelen = old / lo, old / hi
            wavelen = 2 * math.pi / inv
            out = torch.where(wavelen > lo_wavelen, inv / factor, inv)
            smooth = (old / wavelen - lo) / (hi - lo)
            smoothed = (1 - smooth) * out / factor + smooth * out
            medium = ~(wavelen < hi_wavelen) * ~(wavelen > lo_wavelen)
            return torch.where(medium, smoothed, out)
        return inv

    @property
    def max_len(self) -> int | None:
        """The longest sequence this RoPE reproduces transformers for (None: no limit)."""
        if self.rope_type == "longrope":
            return int(self.params["original_max_position_embeddings"])
        return None


def read_rope(
    raw: dict[str, Any],
    where: str,
    *,
    head_dim: int,
    max_pos: int,
    default_theta: float = 10000.0,
    layer_type: str | None = None,
    aliases: dict[str, str] | None = None,
) -> RopeSpec:
    """The RoPE of one layer type (``layer_type`` picks a per-type dict; None means the single one)."""
    params: Any = raw.get("rope_parameters")
    per_type = isinstance(params, dict) and bool(params) and all(isinstance(v, dict) for v in params.values())
    if per_type and layer_type is None:
        raise ValueError(f"{where}: per-layer-type rope_parameters are not supported for this model_type")
    if per_type:
        params = params.get(layer_type) or {}
    params = dict(params or {})
    scaling = raw.get("rope_scaling")
    if isinstance(scaling, dict) and not per_type:
        params = {**scaling, **params}
    theta = params.get("rope_theta", raw.get("rope_theta", default_theta))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    rope_type = (aliases or {}).get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{where}: rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor != 1 is not supported")
    for key in _NEEDED.get(rope_type, []):
        if key not in params and not (key == "original_max_position_embeddings" and key in raw):
            raise ValueError(f"{where}: rope type {rope_type!r} needs {key!r}")
    factor = 1.0
    if rope_type == "longrope":
        orig = int(params.get("original_max_position_embeddings") or raw["original_max_position_embeddings"])
        params["original_max_position_embeddings"] = orig
        for key in ("short_factor", "long_factor"):
            if len(params[key]) != head_dim // 2:
                raise ValueError(
                    f"{where}: rope {key} has {len(params[key])} entries, head_dim/2 is {head_dim // 2}"
                )
        # as transformers: the attention factor follows max_position_embeddings / original unless given
        factor = params.get("attention_factor") or _longrope_attention_factor(
            params.get("factor") or max_pos / orig, orig
        )
    return RopeSpec(rope_type, float(theta), params, float(factor))


def _longrope_attention_factor(factor: float, original: int) -> float:
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original))
