"""Decode throughput of LLMEngine vs Hugging Face `generate`, side by side in one process.

    python -m pdcluster.worker.bench.engine_vs_hf [--threads 2] [--batches 1,16] [--repeats 3] [--profile]

The model is a random ~56M-parameter Llama (hidden 512, 8 layers, 8 heads over 4 KV heads, vocab 32000),
fp32 on CPU. Both sides get the same prompts (128 tokens) and produce exactly 64 new tokens per request
(greedy, EOS ignored). Decode tokens/s is measured the same way for both: the time to generate 64 tokens
minus the time to generate 1 (i.e. prefill + first token), over the 63 tokens in between, times the batch.
Runs alternate engine / HF and the median of the repeats is reported, because the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

MODEL = dict(
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=2048,
    tokenizer=False,
)


def _engine_run(engine: Any, prompts: list[list[int]], new_tokens: int) -> float:
    from pdcluster.worker.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    assert all(len(o) == new_tokens for o in out)
    return dt


def _hf_run(model: Any, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new_tokens
    return dt


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--profile", action="store_true", help="also profile engine decode steps (torch profiler)"
    )
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from pdcluster.worker.demo_model import build_demo_model
    from pdcluster.worker.engine import EngineConfig, LLMEngine
    from transformers import LlamaForCausalLM

    folder = build_demo_model(Path(tempfile.mkdtemp(prefix="pdc-bench-")), **MODEL)
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = LLMEngine(
        EngineConfig(model=str(folder), max_batch_size=16, max_batch_tokens=4096, enable_prefix_caching=False)
    )
    params_m = sum(p.numel() for p in hf.parameters()) / 1e6
    print(
        f"model: {params_m:.1f}M params, fp32, {a.threads} threads, prompt {a.prompt_len}, {a.new_tokens} new"
    )
    g = torch.Generator().manual_seed(0)
    results: dict[str, Any] = {"params_m": round(params_m, 1), "threads": a.threads, "batches": {}}
    for batch in (int(b) for b in a.batches.split(",")):
        prompts = torch.randint(10, 32000, (batch, a.prompt_len), generator=g).tolist()
        _engine_run(engine, prompts, 4), _hf_run(hf, prompts, 4)  # warm-up
        samples: dict[str, list[float]] = {"engine": [], "hf": []}
        for _ in range(a.repeats):
            for name, fn, m in (("engine", _engine_run, engine), ("hf", _hf_run, hf)):
                full, first = fn(m, prompts, a.new_tokens), fn(m, prompts, 1)
                samples[name].append(batch * (a.new_tokens - 1) / max(full - first, 1e-9))
        row = {k: round(statistics.median(v), 1) for k, v in samples.items()}
        row["ratio"] = round(row["engine"] / row["hf"], 2)
        row["samples"] = {k: [round(x, 1) for x in v] for k, v in samples.items()}
        results["batches"][batch] = row
        print(
            f"batch {batch:>3}: engine {row['engine']:>8.1f} tok/s   HF {row['hf']:>8.1f} tok/s   "
            f"ratio {row['ratio']:.2f}x   samples {row['samples']}"
        )
    if a.profile:
        results["profile"] = _profile(engine, a)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return results


def _profile(engine: Any, a: argparse.Namespace) -> dict[str, str]:
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for batch in (1, 16):
        prompts = torch.randint(10, 32000, (batch, a.prompt_len)).tolist()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _engine_run(engine, prompts, a.new_tokens)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
        print(f"\n== engine profile, batch {batch} ==\n{table}")
        out[str(batch)] = table
    return out


if __name__ == "__main__":
    main()
