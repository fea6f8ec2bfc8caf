"""config.json of each family read as transformers reads it (legacy shapes included), and one clear line
for each configuration we cannot run faithfully."""

from __future__ import annotations

from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from pdcluster.worker.engine.config import ModelConfig
from pdcluster.worker.engine.loader import load_model

from .families_util import build_family_model

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4, vocab_size=300)


def _hf(model_type: str, raw: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **raw)


def test_legacy_gemma3_config_matches_transformers():
    """Hub Gemma 3 configs predate layer_types/rope_parameters: rope_theta, rope_local_base_freq,
    rope_scaling (global layers only) and sliding_window_pattern."""
    raw = dict(
        SMALL,
        head_dim=16,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window=512,
        sliding_window_pattern=3,
    )
    ours = ModelConfig.from_dict({"model_type": "gemma3_text", **raw})
    hf = _hf("gemma3_text", raw)
    assert ours.layer_windows == tuple(t == "sliding_attention" for t in hf.layer_types)
    assert ours.layer_windows == (True, True, False) * 2 + (True, True)
    full, local = hf.rope_parameters["full_attention"], hf.rope_parameters["sliding_attention"]
    assert (ours.rope_type, ours.rope_theta, ours.rope_params["factor"]) == (
        "linear",
        full["rope_theta"],
        8.0,
    )
    assert (ours.local_rope.rope_type, ours.local_rope.theta) == ("default", local["rope_theta"])
    assert ours.attn_scale == 256**-0.5 and ours.tie_word_embeddings and ours.hidden_act == "gelu_tanh"
    assert ours.window_of(0) == 512 and ours.window_of(2) is None


def test_legacy_gemma2_and_qwen2_windows_match_transformers():
    g = dict(SMALL, head_dim=16, sliding_window=64)
    ours = ModelConfig.from_dict({"model_type": "gemma2", **g})
    assert ours.layer_windows == tuple(t == "sliding_attention" for t in _hf("gemma2", g).layer_types)
    assert (ours.attn_logit_softcapping, ours.final_logit_softcapping) == (50.0, 30.0)
    q = dict(SMALL, use_sliding_window=True, sliding_window=64, max_window_layers=5)
    ours = ModelConfig.from_dict({"model_type": "qwen2", **q})
    assert ours.layer_windows == tuple(t == "sliding_attention" for t in _hf("qwen2", q).layer_types)
    assert ours.layer_windows == (False,) * 5 + (True,) * 3
    assert (
        ModelConfig.from_dict({"model_type": "qwen2", **q, "use_sliding_window": False}).layer_windows == ()
    )


def test_mistral_window_is_applied_not_a_length_cap():
    cfg = ModelConfig.from_dict(
        {"model_type": "mistral", **SMALL, "sliding_window": 64, "max_position_embeddings": 4096}
    )
    assert cfg.max_position_embeddings == 4096 and all(cfg.layer_windows) and cfg.window_of(3) == 64


@pytest.mark.parametrize(
    "model_type, change, message",
    [
        ("gemma3", {}, "model_type 'gemma3' is not supported (a multimodal checkpoint"),
        (
            "gemma3_text",
            dict(use_bidirectional_attention=True),
            "use_bidirectional_attention=true is not supported",
        ),
        ("gemma2", dict(hidden_activation="gelu"), "hidden_act 'gelu' is not supported"),
        ("gemma2", dict(sliding_window=None), "sliding_window is not set"),
        ("phi3", dict(partial_rotary_factor=0.75), "partial_rotary_factor != 1"),
        (
            "phi3",
            dict(
                rope_scaling={"type": "su", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8},
                original_max_position_embeddings=64,
            ),
            "rope short_factor has 3 entries, head_dim/2 is 8",
        ),
        ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "rope type 'yarn'"),
        ("mixtral", dict(num_local_experts=4), "num_local_experts / num_experts_per_tok are required"),
        (
            "mixtral",
            dict(num_local_experts=2, num_experts_per_tok=3),
            "num_experts_per_tok=3 must be in 1..2",
        ),
        ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2), "'moe_intermediate_size' is missing"),
        ("llama", dict(rope_parameters={"full_attention": {}, "sliding_attention": {}}), "per-layer-type"),
    ],
)
def test_unsupported_options_fail_with_one_clear_line(model_type, change, message):
    raw = {"model_type": model_type, **SMALL, "layer_types": None, **change}
    if model_type in ("gemma2",) and "sliding_window" in change:
        raw["layer_types"] = ["sliding_attention", "full_attention"] * 4
    raw = {k: v for k, v in raw.items() if v is not None or k == "sliding_window"}
    with pytest.raises(ValueError) as e:
        ModelConfig.from_dict(raw, "/models/x")
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("/models/x/config.json: ")


def test_checkpoint_with_an_extra_expert_fails_at_load(tmp_path):
    folder = build_family_model(tmp_path / "m", "mixtral", shard=None)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.block_sparse_moe.experts.4.w1.weight"] = tensors[
        "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    ].clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="names an expert past num_experts=4"):
        load_model(ModelConfig.from_folder(folder))
    del tensors["model.layers.0.block_sparse_moe.experts.4.w1.weight"]
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing tensors: model.layers.1.block_sparse_moe.experts.3.w3"):
        load_model(ModelConfig.from_folder(folder))


@pytest.mark.parametrize("model_type", [["llama"], None, 7])
def test_a_model_type_that_is_not_a_string_is_a_clear_error(model_type: Any) -> None:
    # a list used to escape as TypeError (unhashable) from the membership test
    with pytest.raises(ValueError, match="is not supported"):
        ModelConfig.from_dict({"model_type": model_type, **SMALL})
