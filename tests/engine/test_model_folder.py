"""Config and loader: rope/eos parsing, sharded checkpoints, dtypes, and clear errors for bad folders."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdcluster.worker.engine.config import ModelConfig
from pdcluster.worker.engine.loader import load_model
from pdcluster.worker.local.demo_model import build_demo_model

from .conftest import GREEDY, prompt_of


def test_config_reads_rope_parameters_and_generation_config(tiny_model_dir):
    cfg = ModelConfig.from_folder(tiny_model_dir)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_type) == (4, 2, 16, "default")
    assert cfg.eos_token_ids == (0,)  # <|endoftext|> from generation_config.json
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    legacy = {**raw, "rope_parameters": None, "rope_theta": 1234.0, "eos_token_id": [5, 6]}
    cfg2 = ModelConfig.from_dict(legacy)
    assert cfg2.rope_theta == 1234.0 and cfg2.eos_token_ids == (5, 6)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder, **changes):
    p = folder / "config.json"
    cfg = {**json.loads(p.read_text()), **changes}
    p.write_text(json.dumps({k: v for k, v in cfg.items() if v != "DELETE"}))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(model_type="gpt2"), "model_type 'gpt2' is not supported"),
        (dict(hidden_size="DELETE"), "required field 'hidden_size' is missing"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), "rope type 'yarn'"),
        (dict(num_key_value_heads=3), "not a multiple"),
        (dict(hidden_size=96), "shape"),  # weights disagree with the config
        (dict(num_hidden_layers=4), "missing tensors: model.layers.3"),
    ],
)
def test_bad_config_gives_clear_error(tiny_model_dir_no_tokenizer, tmp_path, change, message):
    folder = _copy(tiny_model_dir_no_tokenizer, tmp_path / "m")
    _edit_config(folder, **change)
    with pytest.raises(ValueError, match=message):
        load_model(ModelConfig.from_folder(folder))


def test_bad_folders_give_clear_errors(tiny_model_dir_no_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        ModelConfig.from_folder(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json is missing"):
        ModelConfig.from_folder(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_folder(tmp_path / "empty")
    folder = _copy(tiny_model_dir_no_tokenizer, tmp_path / "noweights")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no weights found"):
        load_model(ModelConfig.from_folder(folder))
    (folder / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot read safetensors"):
        load_model(ModelConfig.from_folder(folder))


def test_sharded_checkpoint_loads_identically(make_engine, tiny_model_dir_no_tokenizer, tmp_path):
    folder = _copy(tiny_model_dir_no_tokenizer, tmp_path / "sharded")
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, folder / fname)
        weight_map.update(dict.fromkeys(part, fname))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    prompt = prompt_of(20, vocab=500)
    a = make_engine(model=tiny_model_dir_no_tokenizer).generate([prompt], GREEDY)
    b = make_engine(model=folder).generate([prompt], GREEDY)
    assert a == b
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="missing: model-00002-of-00002"):
        make_engine(model=folder)


def test_dtypes_and_bf16_checkpoint(tmp_path):
    folder = build_demo_model(
        tmp_path / "bf16",
        tokenizer=False,
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        dtype="bfloat16",
    )
    cfg = ModelConfig.from_folder(folder)
    assert load_model(cfg).lm_head.weight.dtype == torch.float32  # auto on CPU = fp32
    assert load_model(cfg, "float16").lm_head.weight.dtype == torch.float16
    with pytest.raises(ValueError, match="dtype 'int3'"):
        load_model(cfg, "int3")
