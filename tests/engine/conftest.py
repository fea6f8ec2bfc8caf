"""Engine-test helpers: an engine factory that checks for leaked KV blocks, and the HF oracle."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine
from pdcluster.worker.engine.sampling_params import SamplingParams

# Tiny models gain nothing from intra-op threads, and on a busy shared CI box they only oversubscribe.
torch.set_num_threads(1)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture
def make_engine(tiny_model_dir: Path) -> Iterator[Callable[..., LLMEngine]]:
    """``make_engine(model=..., **EngineConfig fields)``; after the test every engine must be idle with all
    blocks (device and host) back on the free list."""
    engines: list[LLMEngine] = []

    def make(model: str | Path | None = None, **kw: Any) -> LLMEngine:
        kw.setdefault("num_kv_blocks", 256)
        engine = LLMEngine(EngineConfig(model=str(model or tiny_model_dir), **kw))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert not engine.has_unfinished(), "test left requests in the engine"
        assert not engine.seqs, f"requests still hold state: {list(engine.seqs)}"
        engine.block_manager.check_no_leaks()
        if engine.host_block_manager is not None:
            engine.host_block_manager.check_no_leaks()


_HF_CACHE: dict[str, Any] = {}


def hf_model(path: Path | str) -> Any:
    """transformers' own model for a folder (the oracle), cached per folder."""
    from transformers import AutoModelForCausalLM

    key = str(path)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
    return _HF_CACHE[key]


def hf_greedy(path: Path | str, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    """HF generate: greedy token ids and the float32 logits of every step ``[max_new, vocab]``."""
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float()


def run_with_logits(
    engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams = GREEDY
) -> dict[str, tuple[list[int], torch.Tensor]]:
    """Run requests in one continuous batch; per request its tokens and stacked logits."""
    assert engine.config.debug_logits
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    toks: dict[str, list[int]] = {rid: [] for rid in prompts}
    logits: dict[str, list[torch.Tensor]] = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for out in engine.step():
            toks[out.request_id] += out.new_token_ids
            logits[out.request_id].append(out.extra["logits"])
    return {rid: (toks[rid], torch.stack(logits[rid])) for rid in prompts}


def prompt_of(n: int, seed: int = 0, vocab: int = 1000) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()
