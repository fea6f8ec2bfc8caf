"""Tensor-parallel test helpers: tiny HF models saved with transformers, TP engines that are always closed,
and HF's own greedy generate as the oracle. Every TP engine here runs real follower processes over gloo."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine

torch.set_num_threads(1)  # 2 shared cores: every rank is a process already

# 4 query heads over 2 KV heads: TP 2 splits the KV heads (kv == tp), TP 4 replicates them (kv < tp). Vocab
# 250 is no multiple of 4 (vocab padding); attention_bias puts biases on q/k/v and on row-parallel o_proj.
LLAMA = dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, attention_bias=True)
# 4 KV heads at TP 2 (kv > tp), tied embeddings (vocab-parallel embedding and LM head share one slice)
QWEN2 = dict(vocab_size=253, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=True)

# Mixture of experts: the experts and router stay replicated on every rank, attention is sharded
MIXTRAL = dict(vocab_size=250, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2)


def save_model(folder: Path, kind: str, seed: int = 0) -> Path:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(seed)
    if kind == "llama":
        model: Any = LlamaForCausalLM(LlamaConfig(**LLAMA))
    elif kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**MIXTRAL))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN2))
    model.eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tp_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {k: save_model(tmp_path_factory.mktemp(f"tp-{k}"), k) for k in ("llama", "qwen2", "mixtral")}


def tp_config(model: Path, tp: int, **kw: Any) -> EngineConfig:
    kw = {"num_kv_blocks": 64, "num_threads": 1, "block_size": 8, "tensor_parallel_timeout": 20.0, **kw}
    return EngineConfig(model=str(model), tensor_parallel_size=tp, **kw)


@pytest.fixture
def make_tp_engine() -> Iterator[Callable[..., LLMEngine]]:
    """``make_tp_engine(model, tp, **EngineConfig fields)``; every engine (and its followers) is closed after."""
    engines: list[LLMEngine] = []

    def make(model: Path, tp: int, **kw: Any) -> LLMEngine:
        engine = LLMEngine(tp_config(model, tp, **kw))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def hf_greedy(model: Path, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy generate: token ids and the float32 logits of every step ``[max_new, vocab]``."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=max_new,
                          do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
