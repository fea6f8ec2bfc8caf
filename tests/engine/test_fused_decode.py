"""The decode step as one native call (worker/engine/fused_decode.py, kernels/cpu/decoder.cpp): taken for the
dense families whose every layer runs native kernels, with exactly the modules' logits (same kernels, same
order: equal bits, not close ones) in ragged batches, with QKV biases and sliding windows; refused, with the
modules running instead, for the models it does not serve; switched by PDCLUSTER_NATIVE_KERNELS=-decoder at
every step."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from pdcluster.kernels import native
from pdcluster.worker.engine import fused_decode
from tests.native_marks import needs_native

from .conftest import GREEDY, hf_greedy, prompt_of, run_with_logits
from .families_util import BASE, build_family_model

pytestmark = needs_native

PROMPTS = {"a": prompt_of(3, seed=1, vocab=300), "b": prompt_of(29, seed=2, vocab=300),
           "c": prompt_of(70, seed=3, vocab=300)}


@pytest.fixture
def plan_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every decode step the plan ran."""
    seen: list[int] = []
    call = fused_decode.FusedDecode.__call__

    def spy(self: fused_decode.FusedDecode, x: torch.Tensor, *a: Any) -> torch.Tensor:
        seen.append(int(x.shape[0]))
        return call(self, x, *a)

    monkeypatch.setattr(fused_decode.FusedDecode, "__call__", spy)
    return seen


def _both(make_engine: Any, monkeypatch: pytest.MonkeyPatch, model: Path | None = None,
          **kw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    fused = run_with_logits(make_engine(model=model, debug_logits=True, **kw), PROMPTS)
    monkeypatch.setenv(native.SWITCH, "-decoder")
    modules = run_with_logits(make_engine(model=model, debug_logits=True, **kw), PROMPTS)
    return fused, modules


def _assert_same(fused: dict[str, Any], modules: dict[str, Any]) -> None:
    for rid in PROMPTS:
        assert fused[rid][0] == modules[rid][0], rid
        assert torch.equal(fused[rid][1], modules[rid][1]), rid  # bit for bit, every step


def _model(folder: Path, **overrides: Any) -> Path:
    """A random dense model saved by transformers (Qwen2 with QKV biases, Mistral with a sliding window)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(BASE, **overrides)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)  # wider than transformers' init, so every term moves the logits
    model.save_pretrained(folder)
    return folder


def test_llama_decode_takes_the_plan_with_the_modules_bits_and_hf_tokens(
        make_engine: Any, monkeypatch: pytest.MonkeyPatch, plan_calls: list[int], tiny_model_dir: Path) -> None:
    fused, modules = _both(make_engine, monkeypatch, block_size=16)
    assert plan_calls and max(plan_calls) == 3  # the three sequences decode in one call
    steps = len(plan_calls)
    _assert_same(fused, modules)
    assert len(plan_calls) == steps  # switched off: no call
    toks, _ = fused["c"]
    assert toks == hf_greedy(tiny_model_dir, PROMPTS["c"], len(toks))[0]


@pytest.mark.parametrize("family", [dict(model_type="qwen2"),  # q/k/v biases
                                    dict(model_type="mistral", sliding_window=8)])
def test_biases_and_windows_keep_the_modules_bits(family: dict[str, Any], make_engine: Any, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch, plan_calls: list[int]) -> None:
    folder = _model(tmp_path, **family)
    fused, modules = _both(make_engine, monkeypatch, folder, block_size=8)
    assert plan_calls
    _assert_same(fused, modules)


@pytest.mark.parametrize("family, kw, why", [
    ("qwen3", {}, "q/k norm"),
    ("gemma2", {}, "Gemma"),
    ("mixtral", {}, "dense SiLU MLP"),
    (None, {"kv_cache_dtype": "int8"}, "fp32 host cache"),
])
def test_other_models_decode_through_the_modules(family: str | None, kw: dict[str, Any], why: str, make_engine: Any,
                                                 tmp_path: Path, plan_calls: list[int],
                                                 caplog: pytest.LogCaptureFixture) -> None:
    folder = build_family_model(tmp_path, family) if family else None
    with caplog.at_level(logging.INFO, logger="pdcluster.engine"):
        got = run_with_logits(make_engine(model=folder, debug_logits=True, **kw), PROMPTS)
    assert all(len(toks) == 12 for toks, _ in got.values())
    assert not plan_calls
    assert any("decode steps through the modules" in r.message and why in r.message for r in caplog.records)


def test_the_switch_is_read_at_every_step(make_engine: Any, monkeypatch: pytest.MonkeyPatch,
                                         plan_calls: list[int]) -> None:
    reference = run_with_logits(make_engine(debug_logits=True), PROMPTS)
    steps = len(plan_calls)
    engine = make_engine(debug_logits=True)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    toks: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    for i in range(100):
        if not engine.has_unfinished():
            break
        monkeypatch.setenv(native.SWITCH, "-decoder" if i % 2 else "1")
        for out in engine.step():
            toks[out.request_id] += out.new_token_ids
    assert toks == {rid: t for rid, (t, _) in reference.items()}
    assert steps < len(plan_calls) < 2 * steps  # every other decode step of this run took the plan


def test_a_plan_with_inconsistent_layers_is_refused() -> None:
    mod = native.step_module()
    assert mod is not None
    w = torch.ones(8)
    with pytest.raises(RuntimeError, match="per-layer list"):
        mod.DecodePlan(2, 1, 4, 8, 0.5, 0.0, [w], [w, w], [1e-6], [1e-6], [w], [None], [w], [None], [w], [w], [0],
                       [w], [w], w, 1e-6)


@pytest.mark.parametrize("value", ["off", "-decoder,linear", "-gpu"])
def test_a_bad_switch_fails_at_start_and_says_why(make_engine: Any, monkeypatch: pytest.MonkeyPatch,
                                                  value: str) -> None:
    monkeypatch.setenv(native.SWITCH, value)
    with pytest.raises(ValueError, match=native.SWITCH):
        make_engine()
