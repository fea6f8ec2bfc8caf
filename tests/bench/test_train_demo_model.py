"""The demo-model trainer: cache key, corpus split, schedule, and a two-step run on a tiny corpus."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

# scripts/ is not a package: load the trainer from its file, registered so its dataclasses resolve
_SPEC = importlib.util.spec_from_file_location(
    "train_demo_model", Path(__file__).resolve().parents[2] / "scripts" / "train_demo_model.py")
assert _SPEC is not None and _SPEC.loader is not None
tdm = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = tdm
_SPEC.loader.exec_module(tdm)


def test_config_key_is_stable_and_changes_with_the_config():
    assert tdm.DemoConfig().key() == tdm.DemoConfig().key()
    assert tdm.DemoConfig(steps=1).key() != tdm.DemoConfig().key()


def test_heldout_split_is_by_name_and_disjoint():
    files = tdm.stdlib_files()
    held = [f for f in files if tdm.is_heldout(f, 12)]
    assert 0 < len(held) < len(files) // 4
    assert [f.name for f in held] == [f.name for f in files if tdm.is_heldout(f, 12)]


def test_lr_schedule_warms_up_then_decays():
    cfg = tdm.DemoConfig(steps=100, lr=1.0)
    lrs = [tdm.lr_at(s, cfg) for s in range(100)]
    assert lrs[0] < lrs[4] == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(0.1, abs=0.01) and min(lrs[5:]) >= 0.1 - 1e-9


def test_tiny_training_run_writes_a_complete_hf_folder(tmp_path, monkeypatch):
    files = [f for f in tdm.stdlib_files() if f.name in ("bisect.py", "heapq.py", "keyword.py", "this.py",
                                                          "colorsys.py", "genericpath.py", "abc.py")]
    monkeypatch.setattr(tdm, "stdlib_files", lambda: files)
    monkeypatch.setattr(tdm, "CACHE_ROOT", tmp_path)
    cfg = tdm.DemoConfig(vocab_size=300, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                         intermediate_size=64, seq_len=32, batch_size=2, steps=2, heldout_every=3)
    assert tdm.cached_model(cfg) is None
    out = tdm.ensure_demo_model(cfg, log=lambda m: None)
    assert out == tmp_path / cfg.key() and tdm.cached_model(cfg) == out
    for name in ("config.json", "model.safetensors", "tokenizer.json", "heldout.txt", "done"):
        assert (out / name).is_file(), name
    conf = json.loads((out / "config.json").read_text())
    assert conf["num_hidden_layers"] == 1 and conf["vocab_size"] == 300
    from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine
    from pdcluster.worker.engine.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(model=str(out), max_batch_size=1))  # the engine loads it
    assert len(eng.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]) == 3
