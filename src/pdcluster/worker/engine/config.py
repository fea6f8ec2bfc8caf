"""Model configuration read from a Hugging Face model folder.

Only what our decoder needs is kept (family switches live in families.py, RoPE in rope.py). Anything we cannot run faithfully is rejected with a
ValueError that names the folder and the offending field, so `pdcluster serve` fails loudly instead of
producing garbage tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pdcluster.worker.engine.families import (
    FAMILIES,
    Family,
    MoeSpec,
    check_unsupported,
    layer_types,
    read_moe,
)
from pdcluster.worker.engine.rope import SUPPORTED_ROPE_TYPES as SUPPORTED_ROPE_TYPES_
from pdcluster.worker.engine.rope import RopeSpec, read_rope

SUPPORTED_MODEL_TYPES = set(FAMILIES)
SUPPORTED_ROPE_TYPES = set(SUPPORTED_ROPE_TYPES_)
SUPPORTED_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


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
    hidden_act: str = "silu"  # "silu" | "gelu_tanh"
    rope_attention_factor: float = 1.0  # longrope multiplies cos/sin by it
    local_rope: RopeSpec | None = None  # RoPE of sliding-window layers when it differs (Gemma 3)
    sliding_window: int | None = None
    layer_windows: tuple[bool, ...] = ()  # per layer: True = sliding window, empty = none
    query_pre_attn_scalar: float | None = None  # Gemma: scores scale by this**-0.5, not head_dim**-0.5
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    moe: MoeSpec | None = None
    # Tensor parallelism: this config is rank tp_rank's slice of tp_full (head and MLP counts, vocabulary
    # divided; parallel/shard.py builds it). tp_full is None for an unsharded model.
    tp_rank: int = 0
    tp_size: int = 1
    tp_full: ModelConfig | None = None

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @property
    def o_proj_bias(self) -> bool:
        # Llama puts attention_bias on all four projections; Qwen2 only on q/k/v
        return self.attention_bias and self.family.o_proj_bias

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rope(self) -> RopeSpec:
        return RopeSpec(self.rope_type, self.rope_theta, self.rope_params, self.rope_attention_factor)

    def window_of(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_windows and self.layer_windows[layer] else None

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
        if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
            hint = (
                " (a multimodal checkpoint: only its text model, gemma3_text, is supported)"
                if model_type == "gemma3"
                else ""
            )
            raise ValueError(
                f"{where}: model_type {model_type!r} is not supported{hint} "
                f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
            )
        fam = FAMILIES[model_type]
        check_unsupported(raw, where)
        # Gemma's MLP reads hidden_activation (hub configs also carry a stale hidden_act)
        act = (
            (raw.get("hidden_activation") or "gelu_pytorch_tanh")
            if fam.gemma
            else raw.get("hidden_act", "silu")
        )
        if act not in SUPPORTED_ACTS:
            raise ValueError(
                f"{where}: hidden_act {act!r} is not supported (supported: {', '.join(SUPPORTED_ACTS)})"
            )

        def need(key: str) -> Any:
            if key not in raw or raw[key] is None:
                raise ValueError(f"{where}: required field {key!r} is missing")
            return raw[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        layers = int(need("num_hidden_layers"))
        if heads % kv_heads:
            raise ValueError(
                f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        if head_dim % 2:
            raise ValueError(f"{where}: head_dim={head_dim} must be even for RoPE")

        max_pos = int(raw.get("max_position_embeddings") or 2048)
        types = layer_types(raw, fam, layers, where)
        per_type = fam.gemma and model_type == "gemma3_text"
        rope_kw: dict[str, Any] = dict(head_dim=head_dim, max_pos=max_pos, default_theta=fam.default_theta)
        aliases = {"su": "longrope", "yarn": "longrope"} if model_type == "phi3" else None
        if per_type:
            rope = read_rope(raw, where, layer_type="full_attention", **{**rope_kw, "default_theta": 1e6})
            local = read_rope(
                {**raw, "rope_theta": raw.get("rope_local_base_freq", 10000.0), "rope_scaling": None},
                where,
                layer_type="sliding_attention",
                **rope_kw,
            )
        else:
            rope, local = read_rope(raw, where, aliases=aliases, **rope_kw), None
        if rope.max_len is not None:
            # longrope: transformers switches to the long factors once a sequence passes the original length,
            # re-roping new tokens but not the cached ones (history-dependent, and wrong for a shared prefix).
            # We serve up to that length with the short factors, exactly as transformers does there.
            max_pos = min(max_pos, rope.max_len)
        window = raw.get("sliding_window") if "sliding_attention" in types else None
        bias = bool(raw.get("attention_bias", fam.qkv_bias_default))
        eos_ids = eos if eos is not None else _as_ids(raw.get("eos_token_id"))
        return cls(
            path=path,
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            rope_theta=rope.theta,
            rope_type=rope.rope_type,
            rope_params=rope.params,
            rope_attention_factor=rope.attention_factor,
            local_rope=local,
            attention_bias=bias,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", fam.tie_default)),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            hidden_act=SUPPORTED_ACTS[act],
            sliding_window=int(window) if window else None,
            layer_windows=tuple(t == "sliding_attention" for t in types) if window else (),
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)) if fam.gemma else None,
            # Gemma 3's attention ignores attn_logit_softcapping in transformers; so do we
            attn_logit_softcapping=_softcap(raw, "attn_logit_softcapping", 50.0)
            if model_type == "gemma2"
            else None,
            final_logit_softcapping=_softcap(
                raw, "final_logit_softcapping", 30.0 if model_type == "gemma2" else None
            )
            if fam.gemma
            else None,
            moe=read_moe(raw, fam, layers, where),
        )

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies, bit-for-bit as transformers computes them (float32)."""
        return self.rope.inv_freq(self.head_dim, self.max_position_embeddings)


def _softcap(raw: dict[str, Any], key: str, default: float | None) -> float | None:
    value = raw.get(key, default)
    return float(value) if value else None


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
