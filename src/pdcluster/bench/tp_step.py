"""Per-step decode cost of a tensor-parallel engine (TP 2, gloo on CPU) next to the same model at TP 1.

`python -m pdcluster.bench.tp_step [--batch 1 8] [--steps 32] [--rounds 3]`: builds a small random Llama
(no tokenizer), starts a TP 1 engine (1 and 2 threads) and a TP 2 engine (1 thread per rank, one follower
process), fills each with ``batch`` decoding requests, then times ``steps`` decode steps of each engine in
turn, ``rounds`` times (interleaved, so load drifts hit every variant alike). Reports the median ms per
step and TP 2's ratio to TP 1. On CPU TP cannot win: the ranks share the same cores and memory bandwidth
and every step adds gloo round trips (a broadcast, two all_reduces per layer, one for the embedding and an
all_gather of the logits); the figure is the cost of that machinery, which the GPU path (NCCL) replaces.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdcluster.worker.engine.omp_spin import apply_spin_defaults

if TYPE_CHECKING:
    from pdcluster.worker.engine.llm_engine import LLMEngine

MODEL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=8192, max_position_embeddings=2048, tokenizer=False)
PROMPT_LEN = 32


def _fill(engine: LLMEngine, batch: int, max_tokens: int) -> None:
    from pdcluster.worker.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [(7 * i + j) % 8000 + 1 for j in range(PROMPT_LEN)], params)
    while engine.scheduler.waiting:  # prefill everything: from here on every step is a decode step
        engine.step()


def _time_steps(engine: LLMEngine, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps * 1e3


def run(batches: list[int], steps: int, rounds: int) -> list[dict[str, Any]]:
    import torch

    from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine
    from pdcluster.worker.local.demo_model import build_demo_model

    folder = build_demo_model(Path(tempfile.mkdtemp(prefix="tp-step-")), **MODEL)
    variants = {"tp1_t1": (1, 1), "tp1_t2": (1, 2), "tp2_t1": (2, 1)}  # name -> (tp, threads per rank)
    rows = []
    for batch in batches:
        engines = {}
        for name, (tp, threads) in variants.items():
            engines[name] = LLMEngine(EngineConfig(model=str(folder), tensor_parallel_size=tp, num_threads=threads,
                                                   num_kv_blocks=batch * 64, max_batch_size=max(batch, 1)))
        try:
            times: dict[str, list[float]] = {name: [] for name in variants}
            for name, engine in engines.items():
                torch.set_num_threads(variants[name][1])
                _fill(engine, batch, steps * (rounds + 1) + 8)
                _time_steps(engine, 4)  # warm-up
            for _ in range(rounds):
                for name, engine in engines.items():
                    torch.set_num_threads(variants[name][1])
                    times[name].append(_time_steps(engine, steps))
            med = {name: statistics.median(t) for name, t in times.items()}
            rows.append({"batch": batch, **{f"{k}_ms": round(v, 2) for k, v in med.items()},
                         "tp2_vs_tp1_t1": round(med["tp2_t1"] / med["tp1_t1"], 2),
                         "tp2_vs_tp1_t2": round(med["tp2_t1"] / med["tp1_t2"], 2), "rounds": times})
        finally:
            for engine in engines.values():
                for rid in list(engine.seqs):
                    engine.abort(rid)
                engine.close()
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pdcluster.bench.tp_step", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode batch sizes (default 1 8)")
    p.add_argument("--steps", type=int, default=32, help="decode steps per timed round (default 32)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per variant (default 3)")
    args = p.parse_args(argv)
    apply_spin_defaults()  # as `pdcluster serve` does, before torch loads OpenMP (followers inherit it)
    print(f"model: random Llama, {MODEL['num_hidden_layers']} layers, hidden {MODEL['hidden_size']}, MLP "
          f"{MODEL['intermediate_size']}, {MODEL['num_attention_heads']} heads / {MODEL['num_key_value_heads']} KV, "
          f"vocab {MODEL['vocab_size']}, fp32; prompt {PROMPT_LEN}, {args.steps} steps x {args.rounds} rounds")
    print("batch | TP1 1 thread ms/step | TP1 2 threads | TP2 (1 thread/rank) | TP2/TP1-1t | TP2/TP1-2t")
    for r in run(args.batch, args.steps, args.rounds):
        print(f"{r['batch']:5d} | {r['tp1_t1_ms']:8.2f} | {r['tp1_t2_ms']:8.2f} | {r['tp2_t1_ms']:8.2f} | "
              f"{r['tp2_vs_tp1_t1']:.2f}x | {r['tp2_vs_tp1_t2']:.2f}x   rounds {r['rounds']}")


if __name__ == "__main__":
    main()
