"""Decode throughput of LLMEngine vs Hugging Face `generate`, side by side in one process.

    python -m benchmarks.engine_vs_hf [--threads 2] [--batches 1,16] [--repeats 3] [--profile]

The model is a random ~56M-parameter Llama (hidden 512, 8 layers, 8 heads over 4 KV heads, vocab 32000),
fp32 on CPU. Both sides get the same prompts (128 tokens) and produce exactly 64 new tokens per request
(greedy, EOS ignored). Decode tokens/s is measured the same way for both: from the moment every request has its first
token (prefill over) to the last token, over the 63 tokens in between, times the batch (HF's side is timed
with a streamer that only records timestamps). Runs alternate engine / HF; median and best of the repeats
and the median of the per-pair ratios are reported, because the machine is shared and noisy.
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
    """Decode tokens/s: from the first token of the batch to the last, over (new_tokens - 1) x batch."""
    from pdcluster.worker.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{i}", p, params)
    counts = [0] * len(prompts)
    first = last = 0.0
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            counts[int(out.request_id.split("-")[1])] += len(out.new_token_ids)
        if outs and not first and all(counts):
            first = now  # every request has its first token: prefill is over
        last = now
    assert counts == [new_tokens] * len(prompts)
    return len(prompts) * (new_tokens - 1) / (last - first)


class _Clock:
    """A transformers streamer that only timestamps: put() is called with the prompt, then once per step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _hf_run(model: Any, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    clock = _Clock()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            streamer=clock,
        )
    assert out.shape[1] == ids.shape[1] + new_tokens and len(clock.times) == new_tokens + 1
    # times[1]: first token out (prefill over); times[-1]: last token
    return len(prompts) * (new_tokens - 1) / (clock.times[-1] - clock.times[1])


def workload_arguments(ap: argparse.ArgumentParser) -> None:
    """The workload both engine benchmarks share (this one and served_vs_hf), so their runs compare."""
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_arguments(ap)
    ap.add_argument(
        "--profile", action="store_true", help="also profile engine decode steps (torch profiler)"
    )
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from transformers import LlamaForCausalLM

    from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine
    from pdcluster.worker.local.demo_model import build_demo_model

    with tempfile.TemporaryDirectory(prefix="pdc-bench-") as tmp:  # both sides load it into memory
        folder = build_demo_model(Path(tmp), **MODEL)
        hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        engine = LLMEngine(
            EngineConfig(
                model=str(folder), max_batch_size=16, max_batch_tokens=4096, enable_prefix_caching=False
            )
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
        for _ in range(a.repeats):  # interleaved, so both sides see the same background load
            samples["engine"].append(_engine_run(engine, prompts, a.new_tokens))
            samples["hf"].append(_hf_run(hf, prompts, a.new_tokens))
        ratios = [e / h for e, h in zip(samples["engine"], samples["hf"], strict=True)]
        row: dict[str, Any] = {f"{k}_median": round(statistics.median(v), 1) for k, v in samples.items()}
        row.update({f"{k}_best": round(max(v), 1) for k, v in samples.items()})
        row["ratio_median"] = round(row["engine_median"] / row["hf_median"], 2)
        row["ratio_best"] = round(row["engine_best"] / row["hf_best"], 2)
        row["ratio_paired_median"] = round(statistics.median(ratios), 2)
        row["samples"] = {k: [round(x, 1) for x in v] for k, v in samples.items()}
        results["batches"][batch] = row
        print(
            f"batch {batch:>3}: decode tok/s  engine median {row['engine_median']:.1f} best {row['engine_best']:.1f}"
            f" | HF median {row['hf_median']:.1f} best {row['hf_best']:.1f} | ratio median {row['ratio_median']:.2f}x"
            f" best {row['ratio_best']:.2f}x paired {row['ratio_paired_median']:.2f}x | {row['samples']}"
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
