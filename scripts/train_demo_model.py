"""Train the small demo Llama on the Python standard library's own source (`make demo-model`, or
`python scripts/train_demo_model.py`; prints the model folder).

Why: a randomly initialised model cannot show quality loss, so KV-cache quantization would look free.
A few-million-parameter Llama trained for a few minutes on text that is available offline everywhere
(the stdlib's `*.py`) has real attention patterns and a perplexity that moves when K/V are perturbed.

The result is an ordinary Hugging Face folder (config.json, model.safetensors, tokenizer.json) cached
under ~/.cache/pdcluster/demo-model-trained/<config-hash>/, plus `heldout.txt` (stdlib files never trained on)
for perplexity. Training is deterministic for a given config and a fixed number of steps, so the hash
names one model; a `done` marker is written last so an interrupted run is never mistaken for a model.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

# Next to (not inside) the launcher's random demo model, ~/.cache/pdcluster/demo-model: one folder per
# trained config, so changing a hyperparameter never silently reuses a stale model.
CACHE_ROOT = Path(
    os.environ.get("PDCLUSTER_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdcluster"
) / "demo-model-trained"
EOS = "<|endoftext|>"


@dataclass(frozen=True)
class DemoConfig:
    vocab_size: int = 2048
    # ~2.4M parameters: ~0.15 s/step on 2 quiet CPU cores (1500 steps in ~4 minutes; several times
    # longer on a busy machine), big enough to learn indentation, keywords and identifier reuse (what
    # attention, hence the KV cache, carries).
    hidden_size: int = 192
    num_layers: int = 4
    num_heads: int = 6  # head_dim 32 (even, so int4 packs two values per byte)
    num_kv_heads: int = 2  # GQA, so the engine's grouped-KV path is exercised by the demo model too
    intermediate_size: int = 512
    seq_len: int = 128
    batch_size: int = 8
    steps: int = 1500
    lr: float = 3e-3
    seed: int = 0
    heldout_every: int = 12  # roughly 1 in 12 stdlib files is held out for perplexity
    python: str = f"{sys.version_info[0]}.{sys.version_info[1]}"  # the corpus differs per stdlib

    def key(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def model_dir(cfg: DemoConfig = DemoConfig()) -> Path:
    return CACHE_ROOT / cfg.key()


def cached_model(cfg: DemoConfig = DemoConfig()) -> Path | None:
    """The trained folder if it is complete, else None (never trains)."""
    d = model_dir(cfg)
    return d if (d / "done").exists() else None


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(root.glob("*.py"))


def is_heldout(path: Path, every: int) -> bool:
    # Hash of the name, not position, so adding a file to the stdlib does not reshuffle the split.
    return int(hashlib.sha1(path.name.encode()).hexdigest(), 16) % every == 0


def split_corpus(cfg: DemoConfig) -> tuple[str, str]:
    train: list[str] = []
    held: list[str] = []
    for f in stdlib_files():
        text = f.read_text(encoding="utf-8", errors="replace")
        (held if is_heldout(f, cfg.heldout_every) else train).append(text)
    return EOS.join(train), EOS.join(held)


def train_tokenizer(text: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Split on the separator so no merge spans two files.
    tok.train_from_iterator(text.split(EOS), trainer=trainer)
    return tok


def encode(tok, text: str) -> list[int]:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for part in text.split(EOS):
        ids.extend(tok.encode(part).ids)
        ids.append(eos)
    return ids


def lr_at(step: int, cfg: DemoConfig) -> float:
    """Linear warmup then cosine decay to 10%: the usual recipe, robust at this scale."""
    warm = max(1, cfg.steps // 20)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    frac = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def train(cfg: DemoConfig, out: Path, log=print) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    train_text, held_text = split_corpus(cfg)
    t0 = time.time()
    tok = train_tokenizer(train_text, cfg.vocab_size)
    ids = torch.tensor(encode(tok, train_text), dtype=torch.long)
    log(f"tokenizer: {tok.get_vocab_size()} tokens, corpus {len(ids)} tokens ({time.time() - t0:.1f}s)")

    eos = tok.token_to_id(EOS)
    hf_cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    model = LlamaForCausalLM(hf_cfg)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters, {cfg.steps} steps of {cfg.batch_size}x{cfg.seq_len}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(cfg.seed)
    n = len(ids) - cfg.seq_len - 1
    model.train()
    t0 = time.time()
    for step in range(cfg.steps):
        starts = torch.randint(0, n, (cfg.batch_size,), generator=gen)
        batch = torch.stack([ids[s : s + cfg.seq_len + 1] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone()).loss
        # labels are shifted inside the HF loss, so input and labels are the same window.
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == cfg.steps - 1:
            log(f"step {step:4d}  loss {loss.item():.3f}  ppl {math.exp(loss.item()):.1f}  {time.time() - t0:.0f}s")

    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": EOS,
             "model_max_length": 2048},
            indent=1,
        )
    )
    (out / "heldout.txt").write_text(held_text, encoding="utf-8")
    (out / "demo_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    (out / "done").write_text(f"{time.time() - t0:.0f}s\n")
    log(f"saved to {out}")
    return out


def ensure_demo_model(cfg: DemoConfig = DemoConfig(), log=print) -> Path:
    """Return the cached model folder, training it first if needed (minutes on 2 cores)."""
    return cached_model(cfg) or train(cfg, model_dir(cfg), log=log)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=DemoConfig.steps)
    p.add_argument("--force", action="store_true", help="retrain even if cached")
    p.add_argument("--print-path", action="store_true", help="print the cached path (empty if none) and exit")
    a = p.parse_args(argv)
    cfg = DemoConfig(steps=a.steps)
    if a.print_path:
        print(cached_model(cfg) or "")
        return 0
    def log(m: str) -> None:  # progress on stderr: stdout is the folder alone (benchmarks/kv_quality.py reads it)
        print(m, file=sys.stderr)

    path = train(cfg, model_dir(cfg), log=log) if a.force else ensure_demo_model(cfg, log=log)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
