"""CPU weight layout: projections stored column-major after loading, values and tying unchanged.

These cover the torch path (native kernels off); the packed native path is tests/engine/test_cpu_linear.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pdcluster.kernels import native
from pdcluster.worker.engine.config import ModelConfig
from pdcluster.worker.engine.cpu_layout import column_major_linears
from pdcluster.worker.engine.layers import SparseMoE
from pdcluster.worker.engine.loader import load_model

from .families_util import build_family_model


@pytest.fixture(autouse=True)
def _torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.SWITCH, "0")


def _is_column_major(t: torch.Tensor) -> bool:
    return t.transpose(-1, -2).is_contiguous() and not t.is_contiguous()


def test_loaded_cpu_projections_are_column_major_with_the_checkpoint_values(tiny_model_dir: Path) -> None:
    model = load_model(ModelConfig.from_folder(tiny_model_dir))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(_is_column_major(m.weight) for m in linears)
    assert model.embed_tokens.weight.is_contiguous()  # untied: the lookup table keeps its rows
    ref = load_file(str(tiny_model_dir / "model.safetensors"))
    torch.testing.assert_close(model.layers[0].mlp.down_proj.weight, ref["model.layers.0.mlp.down_proj.weight"],
                               atol=0, rtol=0)
    torch.testing.assert_close(model.lm_head.weight, ref["lm_head.weight"], atol=0, rtol=0)


def test_tied_embedding_stays_tied_and_moe_experts_move(tmp_path: Path) -> None:
    tied = load_model(ModelConfig.from_folder(build_family_model(tmp_path / "g", "gemma2")))
    assert tied.lm_head.weight is tied.embed_tokens.weight and _is_column_major(tied.lm_head.weight)
    ids = torch.tensor([3, 7])
    torch.testing.assert_close(tied.embed_tokens(ids), tied.lm_head.weight.contiguous()[ids], atol=0, rtol=0)
    moe = load_model(ModelConfig.from_folder(build_family_model(tmp_path / "m", "mixtral")))
    experts = [m for m in moe.modules() if isinstance(m, SparseMoE)]
    assert experts and all(_is_column_major(m.w13) and _is_column_major(m.w2) for m in experts)


def test_relayout_keeps_outputs_bit_identical_from_16_rows() -> None:
    """MKL packs both layouts for a GEMM: batched decode and prefill see the same bits as before."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96, bias=True)
    x = torch.randn(16, 64)
    before = lin(x)
    assert column_major_linears(lin) == 1 and _is_column_major(lin.weight)
    torch.testing.assert_close(lin(x), before, atol=0, rtol=0)
