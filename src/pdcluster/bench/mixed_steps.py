"""Mixed prefill+decode steps vs alternating prefill / decode steps, two engines side by side in one run.

    python -m pdcluster.bench.mixed_steps [--threads 2] [--decoders 8] [--arrivals 12] [--gap 0.25] [--repeats 3]

The model is engine_vs_hf's random ~56M Llama (fp32, CPU). Each run starts `--decoders` requests (128-token
prompts, 64 greedy tokens) and, once they decode, `--arrivals` more (128-token prompts, 16 tokens) arrive one
every `--gap` seconds of wall time: prompts that land while others decode, which is where the two schedules
differ. Reported per engine: TTFT of the arrivals (arrival -> first token, p50 / p90), TPOT of everything
(p50 / p90 of each request's mean gap after its first token) and the whole run's output tok/s, as medians
over the repeats and as medians of the per-round ratios (mixed / alternating). The two engines (``mixed_steps``
True / False, same weights) run the same requests in each round, in ABBA order (a shared machine's load drifts),
and their greedy tokens are checked identical.
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

from pdcluster.bench.engine_vs_hf import MODEL
from pdcluster.bench.stats import percentile


def run(engine: Any, decoders: list[list[int]], arrivals: list[list[int]], gap: float) -> dict[str, Any]:
    from pdcluster.worker.engine.sampling_params import SamplingParams

    long = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tag = f"{time.perf_counter()}"
    arrive: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    toks: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(decoders):
        rid = f"d{i}-{tag}"
        engine.add_request(rid, p, long)
        arrive[rid], toks[rid] = t0, []
    start = None  # when every decoder has its first token: arrivals are timed from here
    pending = list(enumerate(arrivals))
    while engine.has_unfinished() or pending:
        now = time.perf_counter()
        while pending and start is not None and now >= start + pending[0][0] * gap:
            i, p = pending.pop(0)
            rid = f"a{i}-{tag}"
            engine.add_request(rid, p, short)
            arrive[rid], toks[rid] = now, []
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                toks[out.request_id] += out.new_token_ids
        if start is None and all(f"d{i}-{tag}" in first for i in range(len(decoders))):
            start = now
    ttft = [first[r] - arrive[r] for r in arrive if r.startswith("a")]
    tpot = [(last[r] - first[r]) / (len(toks[r]) - 1) for r in arrive]
    n = sum(len(t) for t in toks.values())
    return {"ttft_p50": statistics.median(ttft), "ttft_p90": percentile(ttft, 90),
            "tpot_p50": statistics.median(tpot), "tpot_p90": percentile(tpot, 90),
            "tok_s": n / (max(last.values()) - t0),
            "tokens": [toks[r] for r in sorted(toks, key=lambda r: (r[0], int(r[1:].split("-")[0])))]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decoders", type=int, default=8)
    ap.add_argument("--arrivals", type=int, default=12)
    ap.add_argument("--gap", type=float, default=0.25, help="seconds between arrivals")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine
    from pdcluster.worker.local.demo_model import build_demo_model

    with tempfile.TemporaryDirectory(prefix="pdc-mixed-") as tmp:
        folder = build_demo_model(Path(tmp), **MODEL)
        engines = {name: LLMEngine(EngineConfig(model=str(folder), max_batch_size=32, max_batch_tokens=4096,
                                                enable_prefix_caching=False, mixed_steps=mixed))
                   for name, mixed in (("mixed", True), ("alternating", False))}
        g = torch.Generator().manual_seed(0)
        samples: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
        for rep in range(a.repeats + 1):  # the first round warms both up and is not reported
            dec = torch.randint(10, 32000, (a.decoders, 128), generator=g).tolist()
            arr = torch.randint(10, 32000, (a.arrivals, 128), generator=g).tolist()
            order = list(engines) if rep % 2 else list(engines)[::-1]
            res = {name: run(engines[name], dec, arr, a.gap) for name in order}
            if res["mixed"].pop("tokens") != res["alternating"].pop("tokens"):
                raise AssertionError("mixed and alternating schedules gave different greedy tokens")
            if rep:
                for name, r in res.items():
                    samples[name].append(r)
    results: dict[str, Any] = {"threads": a.threads, "decoders": a.decoders, "arrivals": a.arrivals, "gap": a.gap}
    for name, rows in samples.items():
        med = {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}
        results[name] = {**med, "samples": rows}
        print(f"{name:>11}: TTFT p50 {1e3 * med['ttft_p50']:.0f} ms p90 {1e3 * med['ttft_p90']:.0f} ms | TPOT p50 "
              f"{1e3 * med['tpot_p50']:.0f} ms p90 {1e3 * med['tpot_p90']:.0f} ms | {med['tok_s']:.1f} tok/s")
    ratios = {k: round(statistics.median(m[k] / o[k] for m, o in zip(samples["mixed"], samples["alternating"],
                                                                      strict=True)), 2)
              for k in samples["mixed"][0]}
    results["ratio_mixed_over_alternating_paired_median"] = ratios
    print(f"mixed / alternating (paired medians): {ratios}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
