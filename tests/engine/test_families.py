"""Each supported family against transformers on tiny random models it wrote itself (sharded safetensors):
greedy tokens identical and fp32 logits close at every step, through chunked prefill, continuous batching,
prefix-cache hits and paged decode with prompts several times longer than the sliding window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdcluster.worker.engine.config import ModelConfig

from .conftest import GREEDY, hf_greedy, prompt_of, run_with_logits
from .families_util import FAMILIES, build_family_model

ATOL = 1e-4
VOCAB = 300
WINDOWED = ["qwen3-sliding", "gemma2", "gemma3", "phi3", "mixtral-sliding"]


@pytest.fixture(scope="module")
def family_dirs() -> dict[str, Path]:
    """Folders built so far in this module, by family (each is built on first use, then shared)."""
    return {}


@pytest.fixture
def family_dir(request: pytest.FixtureRequest, family_dirs: dict[str, Path], tmp_path_factory) -> Path:
    fam = request.param
    if fam not in family_dirs:
        family_dirs[fam] = build_family_model(tmp_path_factory.mktemp(fam), fam)
    return family_dirs[fam]


def _check(folder: Path, prompt: list[int], toks: list[int], logits: torch.Tensor) -> None:
    ref_toks, ref_logits = hf_greedy(folder, prompt, GREEDY.max_tokens)
    assert toks == ref_toks, f"prompt length {len(prompt)}"
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("family_dir", list(FAMILIES), indirect=True)
def test_family_matches_hf(make_engine, family_dir):
    """Prompts of 40 tokens (5 windows of 8), 9 and 1, batched; 16-token steps chunk the long prefill."""
    assert len(list(family_dir.glob("model-*.safetensors"))) > 1, "the checkpoint should be sharded"
    engine = make_engine(model=family_dir, debug_logits=True, block_size=8, max_batch_tokens=16)
    prompts = {"a": prompt_of(40, seed=1, vocab=VOCAB), "b": prompt_of(9, seed=2, vocab=VOCAB)}
    prompts["c"] = prompt_of(1, seed=3, vocab=VOCAB)
    res = run_with_logits(engine, prompts)
    for rid, p in prompts.items():
        _check(family_dir, p, *res[rid])


@pytest.mark.parametrize("family_dir", WINDOWED, indirect=True)
def test_windowed_prefix_hit_and_late_join_match_hf(make_engine, family_dir):
    """A prefix-cache hit makes the windowed prefill read keys back from the cache (only the last window of
    them matters); a request joining mid-decode pads the per-step window gather across unequal lengths."""
    engine = make_engine(model=family_dir, debug_logits=True, block_size=8)
    shared = prompt_of(24, seed=4, vocab=VOCAB)
    run_with_logits(engine, {"warm": shared + prompt_of(3, seed=5, vocab=VOCAB)})
    second = shared + prompt_of(13, seed=6, vocab=VOCAB)
    late = prompt_of(30, seed=7, vocab=VOCAB)
    engine.add_request("b", second, GREEDY)
    toks: dict[str, list[int]] = {"b": [], "late": []}
    logits: dict[str, list[torch.Tensor]] = {"b": [], "late": []}
    steps = 0
    while engine.has_unfinished():
        if steps == 2:
            engine.add_request("late", late, GREEDY)
        for out in engine.step():
            toks[out.request_id] += out.new_token_ids
            logits[out.request_id].append(out.extra["logits"])
        steps += 1
    assert engine.stats()["prefix_cache_hit_blocks"] == 3
    _check(family_dir, second, toks["b"], torch.stack(logits["b"]))
    _check(family_dir, late, toks["late"], torch.stack(logits["late"]))


@pytest.mark.parametrize("family", ["gemma2", "mixtral"])
def test_single_file_checkpoint_loads_the_same(make_engine, family, tmp_path):
    family_dir = build_family_model(tmp_path / "sharded", family)
    single = build_family_model(tmp_path / "single", family, shard=None)
    assert (single / "model.safetensors").is_file()
    prompt = prompt_of(20, seed=8, vocab=VOCAB)
    a = run_with_logits(make_engine(model=family_dir, debug_logits=True), {"r": prompt})["r"]
    b = run_with_logits(make_engine(model=single, debug_logits=True), {"r": prompt})["r"]
    assert a[0] == b[0]
    torch.testing.assert_close(a[1], b[1], atol=0, rtol=0)


@pytest.mark.parametrize("family_dir", ["gemma2", "gemma3", "mixtral"], indirect=True)
@pytest.mark.parametrize("kv", ["int8", "bfloat16"])
def test_quantized_or_half_runs(make_engine, family_dir, kv):
    """int8 KV (windowed and soft-capped layers dequantize in their gather) and bf16 weights: runs, and
    the first greedy token agrees with fp32 transformers (not bit-exact by design)."""
    kw = {"kv_cache_dtype": "int8"} if kv == "int8" else {"dtype": "bfloat16"}
    engine = make_engine(model=family_dir, block_size=8, **kw)
    prompt = prompt_of(30, seed=9, vocab=VOCAB)
    out = engine.generate([prompt], GREEDY)[0]
    assert len(out) == GREEDY.max_tokens
    assert out[0] == hf_greedy(family_dir, prompt, 1)[0][0]


def test_longrope_serves_up_to_the_original_length(make_engine, tmp_path):
    """Past original_max_position_embeddings transformers switches to the long factors mid-sequence (and
    keeps the cached keys roped with the short ones); we serve up to that length, and say so."""
    folder = build_family_model(tmp_path / "phi3", "phi3-longrope")
    cfg = ModelConfig.from_folder(folder)
    assert cfg.rope_type == "longrope" and cfg.max_position_embeddings == 64
    assert cfg.rope_attention_factor == pytest.approx(
        (1 + torch.log(torch.tensor(4.0)).item() / 4.1588830833596715) ** 0.5
    )
    engine = make_engine(model=folder)
    assert engine.max_model_len == 64
    with pytest.raises(ValueError, match="64"):
        engine.add_request("long", prompt_of(70, vocab=VOCAB), GREEDY)
