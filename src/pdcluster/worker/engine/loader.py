"""Load a Hugging Face checkpoint (single or sharded safetensors) of a supported family into our fused model."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pdcluster.worker.engine.config import ModelConfig
from pdcluster.worker.engine.cpu_layout import column_major_linears
from pdcluster.worker.engine.cpu_linear import pack_linears
from pdcluster.worker.engine.model import DecoderForCausalLM
from pdcluster.worker.engine.parallel.collectives import install as install_collectives
from pdcluster.worker.engine.parallel.shard import slice_weight

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

# HF name suffix -> (our parameter suffix, shard index within the fused tensor)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
# Per-expert tensors as the hub stores them: Mixtral (w1 gate, w3 up, w2 down) and Qwen-MoE names
_EXPERT = re.compile(
    r"^layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$"
)
_EXPERT_PART: dict[str, tuple[str, int | None]] = {"w1": ("w13", 0), "gate_proj": ("w13", 0), "w3": ("w13", 1), "up_proj": ("w13", 1)}
_EXPERT_PART.update({"w2": ("w2", None), "down_proj": ("w2", None)})


def _target(name: str, cfg: ModelConfig) -> tuple[str, int | None, int | None]:
    """Our parameter for an HF tensor name (without "model."): (name, expert index, row offset)."""
    m = _EXPERT.match(name)
    if m is not None and cfg.moe is not None:
        layer, expert, part = m.groups()
        ours, shard = _EXPERT_PART[part]
        offset = None if shard is None else shard * cfg.moe.intermediate_size
        return f"layers.{layer}.mlp.{ours}", int(expert), offset
    name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
    if cfg.family.fused_checkpoint:  # Phi-3 stores qkv_proj / gate_up_proj already fused, in our layout
        return name, None, None
    q, kv = cfg.q_size, cfg.kv_size
    offsets = {"self_attn.qkv_proj": [0, q, q + kv], "mlp.gate_up_proj": [0, cfg.intermediate_size]}
    for hf_part, (ours, shard) in _FUSED.items():
        if f".{hf_part}." in f".{name}":
            return name.replace(hf_part, ours), None, offsets[ours][shard]
    return name, None, None


def resolve_dtype(name: str | torch.dtype, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """ "auto" means the checkpoint's dtype on CUDA and float32 on CPU (half matmuls are slow there)."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return DTYPES.get(cfg.torch_dtype, torch.float16)
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported (use float32, bfloat16 or float16)")
    return DTYPES[name]


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from e
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{folder}: shard(s) named in the index are missing: {', '.join(missing)}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    if list(folder.glob("*.bin")) or list(folder.glob("*.pth")):
        raise ValueError(f"{folder}: only safetensors checkpoints are supported (found .bin/.pth weights)")
    raise ValueError(
        f"{folder}: no weights found (expected model.safetensors or model.safetensors.index.json)"
    )


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                    yield name, fh.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            if isinstance(e, ValueError) and str(f) in str(e):
                raise
            raise ValueError(f"{f}: cannot read safetensors file ({e})") from e


def load_model(
    cfg: ModelConfig,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    max_len: int | None = None,
) -> DecoderForCausalLM:
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, cfg, device)
    folder = Path(cfg.path)
    files = checkpoint_files(folder)
    with torch.device("meta"):
        model = DecoderForCausalLM(cfg)
    model = model.to_empty(device=device).to(torch_dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for hf_name, tensor in iter_tensors(files):
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name:
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if cfg.tp_size > 1:  # this rank's slice only (parallel/shard.py)
            tensor = slice_weight(name, tensor, cfg)
        target, expert, offset = _target(name, cfg)
        if target not in params:
            raise ValueError(f"{folder}: unexpected tensor {hf_name!r} (not a {cfg.model_type} checkpoint?)")
        dst = params[target].data
        if expert is not None:
            if expert >= dst.shape[0]:
                raise ValueError(
                    f"{folder}: tensor {hf_name!r} names an expert past num_experts={dst.shape[0]}"
                )
            dst = dst[expert]
        if offset is not None:
            if offset + tensor.shape[0] <= dst.shape[0]:
                dst = dst.narrow(0, offset, tensor.shape[0])
            else:  # too many rows for its slice of the fused tensor: report the slice's real size
                dst = dst[offset:]
        if dst.shape != tensor.shape:
            raise ValueError(
                f"{folder}: tensor {hf_name!r} has shape {tuple(tensor.shape)}, config.json implies {tuple(dst.shape)}"
            )
        dst.copy_(tensor.to(torch_dtype))
        loaded.add(hf_name)
    expected = _expected_names(cfg)
    missing = sorted(expected - loaded)
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ValueError(f"{folder}: checkpoint is missing tensors: {', '.join(missing[:3])}{more}")
    model.init_rope(max_len or cfg.max_position_embeddings)
    if cfg.tp_size > 1:  # sums and gathers across ranks (parallel/collectives.py)
        install_collectives(model, cfg)
    if device.type == "cpu":  # fp32 projections on the native packed kernel (cpu_linear.py) where it builds;
        if cfg.tp_size == 1:  # the rest column-major: MKL's GEMV streams it ~1.7x faster (cpu_layout.py)
            pack_linears(model)
        column_major_linears(model)
    return model.eval()


def _expected_names(cfg: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    fam = cfg.family
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        if fam.fused_checkpoint:
            names.update((p + "self_attn.qkv_proj.weight", p + "self_attn.o_proj.weight"))
        else:
            names.update(p + f"self_attn.{part}.weight" for part in ("q_proj", "k_proj", "v_proj", "o_proj"))
        if cfg.attention_bias:
            names.update(p + f"self_attn.{part}.bias" for part in ("q_proj", "k_proj", "v_proj"))
        if cfg.o_proj_bias:
            names.add(p + "self_attn.o_proj.bias")
        if fam.qk_norm:
            names.update((p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"))
        names.update(_mlp_names(cfg, i, p))
        names.update((p + "input_layernorm.weight", p + "post_attention_layernorm.weight"))
        if fam.gemma:
            names.update((p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"))
    return names


def _mlp_names(cfg: ModelConfig, layer: int, p: str) -> list[str]:
    if cfg.moe is not None and cfg.moe.layers[layer]:
        if cfg.moe.weights_in_fp32:  # Mixtral's names
            experts = [
                f"block_sparse_moe.experts.{e}.{w}"
                for e in range(cfg.moe.num_experts)
                for w in ("w1", "w2", "w3")
            ]
            return [p + n + ".weight" for n in ["block_sparse_moe.gate", *experts]]
        parts = ("gate_proj", "up_proj", "down_proj")
        experts = [f"mlp.experts.{e}.{w}" for e in range(cfg.moe.num_experts) for w in parts]
        return [p + n + ".weight" for n in ["mlp.gate", *experts]]
    if cfg.family.fused_checkpoint:
        return [p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"]
    return [p + f"mlp.{part}.weight" for part in ("gate_proj", "up_proj", "down_proj")]
