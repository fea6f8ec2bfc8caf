"""A tiny random Llama written as an ordinary Hugging Face folder, without transformers.

`pdcluster up` with no `--model` and the test suite both need a model that exists on a fresh machine with
no network. The weights are random (text output is gibberish, but every code path runs); the tokenizer is a
real byte-level BPE trained in about a second on a little Python source, so text prompts, streaming
detokenization and chat templates are exercised for real.

The training text ships with the package (`demo_corpus.txt.xz`: twelve modules of CPython 3.11.7's standard
library, PSF License, NUL-separated) instead of being read from the running interpreter: patch releases
change those files (Debian's 3.11.2 has another argparse.py and calendar.py than 3.11.7), which trained a
different vocabulary, so the worker image's /models/demo and a `pdcluster up` demo model built elsewhere
decoded the same token ids to different text (found by the real-node e2e, docs/e2e.md).
"""

from __future__ import annotations

import json
import lzma
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Twelve stdlib modules (textwrap, string, heapq, bisect, fractions, shlex, json/decoder, argparse, random,
# csv, calendar, difflib) of CPython 3.11.7, as they were read from the interpreter before: a few hundred KB.
CORPUS_FILE = Path(__file__).with_name("demo_corpus.txt.xz")


def _corpus() -> list[str]:
    texts = lzma.decompress(CORPUS_FILE.read_bytes()).decode("utf-8").split("\x00")
    # a little non-ASCII so multi-byte characters get split across tokens, as they do in real models
    return texts + ["naïve café — déjà vu, 日本語のテキスト, emoji 🙂🚀, Grüße aus Zürich."] * 50


def build_tokenizer(vocab_size: int = 1024) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` (any byte string encodes; ids < vocab_size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def build_demo_model(path: str | Path, **overrides: Any) -> Path:
    """Write config.json, model.safetensors, generation_config.json, tokenizer.json and
    tokenizer_config.json for a random Llama into ``path``; returns the folder.

    ``overrides`` are config.json fields (hidden_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, intermediate_size, vocab_size, head_dim, rope_parameters, attention_bias,
    tie_word_embeddings, ...) plus ``seed`` (weights), ``tokenizer`` (False: no tokenizer files),
    ``tokenizer_vocab_size`` and ``dtype`` ("float32" | "bfloat16" | "float16").
    """
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    seed = int(overrides.pop("seed", 0))
    with_tokenizer = bool(overrides.pop("tokenizer", True))
    tok_vocab = int(overrides.pop("tokenizer_vocab_size", 1024))
    dtype_name = str(overrides.pop("dtype", "float32"))
    eos_id: int | None = None
    if with_tokenizer:
        tok = build_tokenizer(tok_vocab)
        tok.save(str(folder / "tokenizer.json"))
        eos_id = tok.token_to_id(EOS)
        tok_cfg = {
            "bos_token": None,
            "eos_token": EOS,
            "chat_template": CHAT_TEMPLATE,
            "model_max_length": 2048,
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
        overrides.setdefault("vocab_size", tok.get_vocab_size())
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1024,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "initializer_range": 0.02,
        "dtype": dtype_name,
    }
    cfg.update(overrides)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": cfg["eos_token_id"]}, indent=2)
    )
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    save_file(_random_weights(cfg, seed, dtype), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _random_weights(cfg: dict[str, Any], seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    std = cfg["initializer_range"]

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    w = {"model.embed_tokens.weight": rnd(vocab, h), "model.norm.weight": torch.ones(h, dtype=dtype)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rnd(vocab, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rnd(heads * d, h)
        w[p + "self_attn.k_proj.weight"] = rnd(kv_heads * d, h)
        w[p + "self_attn.v_proj.weight"] = rnd(kv_heads * d, h)
        w[p + "self_attn.o_proj.weight"] = rnd(h, heads * d)
        if cfg.get("attention_bias"):
            for name, n in (("q_proj", heads * d), ("k_proj", kv_heads * d), ("v_proj", kv_heads * d)):
                w[p + f"self_attn.{name}.bias"] = rnd(n)
            if cfg["model_type"] != "qwen2":  # Qwen2 has bias on q/k/v only
                w[p + "self_attn.o_proj.bias"] = rnd(h)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, h)
        w[p + "mlp.up_proj.weight"] = rnd(inter, h)
        w[p + "mlp.down_proj.weight"] = rnd(h, inter)
        w[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
    return w


if __name__ == "__main__":  # python -m pdcluster.worker.local.demo_model OUT_DIR
    import sys

    print(build_demo_model(sys.argv[1] if len(sys.argv) > 1 else "demo-model"))
