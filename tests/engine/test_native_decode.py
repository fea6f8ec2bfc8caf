"""The engine's CPU decode through the native attention kernel: it is taken where it can be, its logits are
those of the torch path (to float32 rounding) in ragged batches, sliding windows, soft-capping and int8
caches, its greedy tokens are HF's, and switched off the engine takes the torch path again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdcluster.kernels import native
from pdcluster.worker.engine import attention
from tests.native_marks import needs_native

from .conftest import hf_greedy, prompt_of, run_with_logits
from .families_util import build_family_model

pytestmark = needs_native


@pytest.fixture(autouse=True)
def _modules_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the modules' call of the kernel, which they spy on; the whole-step plan calls the
    same kernel from C++ (tests/engine/test_fused_decode.py)."""
    monkeypatch.setenv(native.SWITCH, "-decoder")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts native kernel calls (the batch size of each)."""
    seen: list[int] = []
    kernel = attention.native.paged_decode_attention

    def spy(q: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
        seen.append(q.shape[0])
        return kernel(q, *a, **kw)

    monkeypatch.setattr(attention.native, "paged_decode_attention", spy)
    return seen


def both_paths(make_engine: Any, monkeypatch: pytest.MonkeyPatch, prompts: dict[str, list[int]],
               **kw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    native_run = run_with_logits(make_engine(debug_logits=True, **kw), prompts)
    monkeypatch.setattr(attention.native, "attention_available", lambda *a: False)
    torch_run = run_with_logits(make_engine(debug_logits=True, **kw), prompts)
    return native_run, torch_run


def test_ragged_batch_takes_the_kernel_and_matches_hf(make_engine, tiny_model_dir: Path, calls: list[int]):
    prompts = {"a": prompt_of(5, seed=1), "b": prompt_of(37, seed=2), "c": prompt_of(70, seed=3)}
    got = run_with_logits(make_engine(debug_logits=True, block_size=16), prompts)
    assert calls and max(calls) == 3, calls  # every decode layer, the three sequences in one call
    for rid, p in prompts.items():
        toks, _ = got[rid]
        assert toks == hf_greedy(tiny_model_dir, p, len(toks))[0], rid


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_logits_equal_the_torch_path(make_engine, monkeypatch, calls, kv):
    prompts = {"a": prompt_of(9, seed=4), "b": prompt_of(50, seed=5)}
    nat, ref = both_paths(make_engine, monkeypatch, prompts, kv_cache_dtype=kv, block_size=8)
    assert calls
    for rid in prompts:
        assert nat[rid][0] == ref[rid][0], rid
        torch.testing.assert_close(nat[rid][1], ref[rid][1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["gemma2", "qwen3-sliding"])
def test_windowed_and_softcapped_families(make_engine, monkeypatch, calls, tmp_path, family):
    """gemma2: soft-capped global layers and windowed ones; qwen3-sliding: a window of 8 on one layer.
    Prompts several windows long, decoded past them, in one ragged batch."""
    folder = build_family_model(tmp_path, family)
    prompts = {"a": prompt_of(30, seed=6, vocab=300), "b": prompt_of(3, seed=7, vocab=300)}
    nat, ref = both_paths(make_engine, monkeypatch, prompts, model=folder, block_size=8)
    assert calls
    for rid, p in prompts.items():
        assert nat[rid][0] == ref[rid][0] == hf_greedy(folder, p, len(nat[rid][0]))[0], rid
        torch.testing.assert_close(nat[rid][1], ref[rid][1], atol=1e-5, rtol=1e-4)


def test_off_means_the_torch_path(make_engine, monkeypatch, calls):
    monkeypatch.setattr(attention.native, "attention_available", lambda *a: False)
    run_with_logits(make_engine(debug_logits=True), {"a": prompt_of(12, seed=8)})
    assert calls == []
