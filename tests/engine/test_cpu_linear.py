"""CPU fp32 projections swapped onto the native packed kernel at load (worker/engine/cpu_linear.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pdcluster.kernels import native
from pdcluster.worker.engine.config import ModelConfig
from pdcluster.worker.engine.cpu_linear import PackedEmbedding, PackedLinear, pack_linears
from pdcluster.worker.engine.loader import load_model
from tests.native_marks import needs_native

from .families_util import build_family_model

pytestmark = needs_native


def _pairs(on: nn.Module, off: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    off_mods = dict(off.named_modules())
    return [(name, m, off_mods[name]) for name, m in on.named_modules() if isinstance(m, PackedLinear)]


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3", "mixtral"])
def test_swapped_projections_match_the_torch_path(tmp_path: Path, family: str, monkeypatch) -> None:
    folder = build_family_model(tmp_path / family, family) if family != "llama" else None
    if folder is None:
        from pdcluster.worker.local.demo_model import build_demo_model

        folder = build_demo_model(tmp_path / "llama", tokenizer=False, vocab_size=300, hidden_size=96,
                                  intermediate_size=200, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, attention_bias=True)
    cfg = ModelConfig.from_folder(folder)
    on = load_model(cfg)
    monkeypatch.setenv(native.SWITCH, "0")
    off = load_model(cfg)
    pairs = _pairs(on, off)
    # every dense projection and the LM head swapped; an MoE router keeps MKL (its logits pick experts)
    assert pairs and all(type(ref) is nn.Linear for _, _, ref in pairs)
    assert not any(isinstance(m, nn.Linear) and not name.endswith(".gate") for name, m in on.named_modules())
    torch.manual_seed(0)
    with torch.inference_mode():
        for name, got, ref in pairs:
            torch.testing.assert_close(got.weight, ref.weight, atol=0, rtol=0, msg=name)
            for m in (1, 16, 100):  # decode and prefill rows, all on the kernel
                x = torch.randn(m, got.in_features)
                torch.testing.assert_close(got(x), ref(x), atol=1e-5, rtol=1e-5, msg=f"{name} M={m}")
        ids = torch.tensor([[0, 5], [cfg.vocab_size - 1, 64]])
        torch.testing.assert_close(on.embed_tokens(ids), off.embed_tokens(ids), atol=0, rtol=0)


def test_tied_head_and_embedding_share_one_packed_tensor(tmp_path: Path) -> None:
    model = load_model(ModelConfig.from_folder(build_family_model(tmp_path / "g", "gemma2")))
    assert isinstance(model.lm_head, PackedLinear) and isinstance(model.embed_tokens, PackedEmbedding)
    assert model.embed_tokens.wp is model.lm_head.wp  # one copy of the tied matrix in memory
    names = [n for n, _ in model.named_parameters()]
    assert names.count("lm_head.wp") + names.count("embed_tokens.wp") == 1
    with pytest.raises(IndexError, match="out of range"):
        model.embed_tokens(torch.tensor([model.cfg.vocab_size]))


@pytest.mark.parametrize("value", ["0", "-linear", "-attention,-linear"])
def test_off_switch_keeps_the_torch_path(tiny_model_dir: Path, monkeypatch, value: str) -> None:
    monkeypatch.setenv(native.SWITCH, value)
    model = load_model(ModelConfig.from_folder(tiny_model_dir))
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert pack_linears(model) == 0


def test_half_dtypes_keep_torch_and_large_batches_go_to_mkl(tiny_model_dir: Path) -> None:
    model = load_model(ModelConfig.from_folder(tiny_model_dir), "bfloat16")
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    torch.manual_seed(1)
    ref = nn.Linear(40, 70, bias=True)
    x = torch.randn(3, 400, 40)  # 1200 rows: MKL over the panels; leading dims kept
    expected, one = ref(x), ref(x[0, :1])
    packed = nn.Sequential(ref)
    assert pack_linears(packed) == 1 and isinstance(packed[0], PackedLinear)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed(x[0, :1]), one, atol=1e-5, rtol=1e-5)
