"""The decode step as one native call (``worker/engine/fused_decode.py``) vs the same kernels called from the
modules, side by side in one process.

    python -m pdcluster.bench.fused_step [--threads 2] [--batches 1,16] [--repeats 8] [--json PATH]

engine_vs_hf's random 56M Llama and workload (fp32, CPU; ``--prompt-len`` 128, ``--new-tokens`` 64); each round
sends ``batch`` fresh prompts and times every decode step (greedy), once with ``PDCLUSTER_NATIVE_DECODER`` on and once off, the order
alternating round by round. Reported: the median step of each side and the median of the per-round ratios
(modules / plan), the figure least moved by this shared machine's load. Tokens are checked equal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pdcluster.worker.engine.fused_decode import SWITCH


def _round(engine: Any, batch: int, a: argparse.Namespace, g: torch.Generator) -> tuple[float, list[list[int]]]:
    from pdcluster.worker.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=a.new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r-{i}", torch.randint(10, 32000, (a.prompt_len,), generator=g).tolist(), params)
    toks: dict[str, list[int]] = {}
    steps: list[float] = []
    first = True
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        if not first:
            steps.append(time.perf_counter() - t0)
        first = False
        for out in outs:
            toks.setdefault(out.request_id, []).extend(out.new_token_ids)
    return statistics.median(steps), [toks[f"r-{i}"] for i in range(batch)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from pdcluster.bench.engine_vs_hf import MODEL, workload_arguments

    workload_arguments(ap)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine
    from pdcluster.worker.local.demo_model import build_demo_model

    with tempfile.TemporaryDirectory(prefix="pdc-bench-") as tmp:
        folder = build_demo_model(Path(tmp), **MODEL)
        engine = LLMEngine(EngineConfig(model=str(folder), max_batch_size=16, max_batch_tokens=4096,
                                        enable_prefix_caching=False))
    results: dict[str, Any] = {"threads": a.threads, "batches": {}}
    for batch in (int(b) for b in a.batches.split(",")):
        _round(engine, batch, a, torch.Generator().manual_seed(0))  # warm-up (builds the plan)
        samples: dict[str, list[float]] = {"plan": [], "modules": []}
        for r in range(a.repeats):
            toks = {}
            for side in (("plan", "modules") if r % 2 == 0 else ("modules", "plan")):
                os.environ[SWITCH] = "1" if side == "plan" else "0"
                step, toks[side] = _round(engine, batch, a, torch.Generator().manual_seed(100 + r))
                samples[side].append(step)
            if toks["plan"] != toks["modules"]:
                raise AssertionError(f"batch {batch}, round {r}: the plan's greedy tokens differ from the modules'")
        os.environ.pop(SWITCH, None)
        ratios = [m / p for p, m in zip(samples["plan"], samples["modules"], strict=True)]
        row: dict[str, Any] = {f"{k}_step_ms": round(statistics.median(v) * 1e3, 2) for k, v in samples.items()}
        row["speedup_paired_median"] = round(statistics.median(ratios), 3)
        row["speedup_paired_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
        results["batches"][batch] = row
        print(f"batch {batch}: plan {row['plan_step_ms']} ms, modules {row['modules_step_ms']} ms a step; "
              f"paired modules/plan {row['speedup_paired_median']}x {row['speedup_paired_range']}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
