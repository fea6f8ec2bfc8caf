"""Model configuration read from a Hugging Face model folder.

Only what the Llama-family decoder needs is kept. Anything we cannot run faithfully is rejected with a
ValueError that names the folder and the offending field, so `pdcluster serve` fails loudly instead of
producing garbage tokens.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# Architectures that are a plain pre-norm Llama decoder (RMSNorm, RoPE, SwiGLU, GQA).
SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2"}
SUPPORTED_ROPE_TYPES = {"default", "linear", "llama3"}


@dataclass(frozen=True)
class ModelConfig:
    path: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_type: str = "default"
    rope_params: dict[str, Any] = field(default_factory=dict)
    attention_bias: bool = False  # qkv bias (Qwen2 always, Llama when attention_bias=true)
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "float32"

    @property
    def o_proj_bias(self) -> bool:
        # Llama puts attention_bias on all four projections; Qwen2 only on q/k/v
        return self.attention_bias and self.model_type != "qwen2"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        folder = Path(path)
        if not folder.is_dir():
            raise ValueError(f"model folder {str(folder)!r} does not exist or is not a directory")
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"{str(folder)!r} is not a Hugging Face model folder: config.json is missing")
        try:
            raw = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path}: not valid JSON ({e})") from e
        if not isinstance(raw, dict):
            raise ValueError(f"{cfg_path}: expected a JSON object")
        return cls.from_dict(raw, str(folder), _read_eos(folder, raw))

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], path: str = "<dict>", eos: tuple[int, ...] | None = None
    ) -> ModelConfig:
        where = f"{path}/config.json"
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{where}: model_type {model_type!r} is not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
            )
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"{where}: hidden_act {act!r} is not supported (only silu)")
        if raw.get("mlp_bias"):
            raise ValueError(f"{where}: mlp_bias=true is not supported")

        def need(key: str) -> Any:
            if key not in raw or raw[key] is None:
                raise ValueError(f"{where}: required field {key!r} is missing")
            return raw[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ValueError(
                f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        if head_dim % 2:
            raise ValueError(f"{where}: head_dim={head_dim} must be even for RoPE")

        rope_type, theta, rope_params = _rope(raw, where)
        max_pos = int(raw.get("max_position_embeddings") or 2048)
        # Mistral's sliding window only matters past the window; cap the usable length there instead of
        # silently attending further than the model was trained to.
        window = raw.get("sliding_window")
        if window and (model_type != "qwen2" or raw.get("use_sliding_window")):
            max_pos = min(max_pos, int(window))
        bias = bool(raw.get("attention_bias", model_type == "qwen2"))
        eos_ids = eos if eos is not None else _as_ids(raw.get("eos_token_id"))
        return cls(
            path=path,
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            rope_theta=theta,
            rope_type=rope_type,
            rope_params=rope_params,
            attention_bias=bias,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies, bit-for-bit as transformers computes them (float32)."""
        dim = self.head_dim
        inv = 1.0 / (
            self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim)
        )
        p = self.rope_params
        if self.rope_type == "linear":
            return inv / p["factor"]
        if self.rope_type == "llama3":
            factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
            old = p.get("original_max_position_embeddings") or self.max_position_embeddings
            lo_wavelen, hi_wavelen = old / lo, old / hi
            wavelen = 2 * math.pi / inv
            out = torch.where(wavelen > lo_wavelen, inv / factor, inv)
            smooth = (old / wavelen - lo) / (hi - lo)
            smoothed = (1 - smooth) * out / factor + smooth * out
            medium = ~(wavelen < hi_wavelen) * ~(wavelen > lo_wavelen)
            return torch.where(medium, smoothed, out)
        return inv


def _rope(raw: dict[str, Any], where: str) -> tuple[str, float, dict[str, Any]]:
    """Read RoPE from transformers-5 `rope_parameters` or the older `rope_theta` + `rope_scaling`."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{where}: per-layer-type rope_parameters are not supported")
    params = dict(params or {})
    scaling = raw.get("rope_scaling")
    if isinstance(scaling, dict):
        params = {**scaling, **params}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{where}: rope type {rope_type!r} is not supported (supported: {', '.join(sorted(SUPPORTED_ROPE_TYPES))})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor != 1 is not supported")
    needed = {"linear": ["factor"], "llama3": ["factor", "low_freq_factor", "high_freq_factor"]}.get(
        rope_type, []
    )
    for key in needed:
        if key not in params:
            raise ValueError(f"{where}: rope type {rope_type!r} needs {key!r}")
    return rope_type, float(theta), params


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _read_eos(folder: Path, raw: dict[str, Any]) -> tuple[int, ...]:
    """generation_config.json wins over config.json: it is what `generate` stops on."""
    gen = folder / "generation_config.json"
    if gen.is_file():
        try:
            ids = _as_ids(json.loads(gen.read_text()).get("eos_token_id"))
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            raise ValueError(f"{gen}: cannot read eos_token_id ({e})") from e
        if ids:
            return ids
    return _as_ids(raw.get("eos_token_id"))
