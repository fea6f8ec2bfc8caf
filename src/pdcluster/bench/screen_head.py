"""Greedy's LM head: the fp32 packed kernel + argmax vs the bf16 screen, side by side in one process.

    python -m pdcluster.bench.screen_head [--threads 2] [--rows 1,4,6,8,16] [--repeats 25] [--json PATH]

Kernel ``kernels/cpu/screen.cpp`` (wrapper ``kernels/cpu/screen.py``), its reference ``argmax(linear(h))``
(the engine's fp32 path: ``linear.cpp`` then ``argmax.cpp``) and this benchmark together. The head is the
56M benchmark model's (32000 x 512, fp32, initialised like transformers' Llama: N(0, 0.02)); hidden rows are
drawn two ways: ``random`` (unit normal, what a final RMSNorm hands over) and ``peaked`` (a row of the head
scaled up plus noise: a confident step, one clear winner). Every answer is checked against the reference
before timing; undecided rows (the engine then runs the fp32 head) are counted. Variants alternate repeat by
repeat; between calls a 64 MiB buffer is read so that each call starts with the head out of the caches, as
in a decode step where the layers ran in between. The box is shared: only the ratios of one run mean anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from pdcluster.bench.engine_vs_hf import MODEL
from pdcluster.kernels.cpu import argmax as native_argmax
from pdcluster.kernels.cpu import linear as native_linear
from pdcluster.kernels.cpu import screen


def hidden_rows(kind: str, w: torch.Tensor, m: int, g: torch.Generator) -> torch.Tensor:
    k = w.shape[1]
    if kind == "random":
        return torch.randn(m, k, generator=g)
    picks = torch.randint(0, w.shape[0], (m,), generator=g)
    return w[picks] * 40 + torch.randn(m, k, generator=g) * 0.5


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,6,8,16")
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    reason = screen.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"the bf16 screen cannot run here: {reason}")
    torch.set_num_threads(a.threads)
    n, k = int(MODEL["vocab_size"]), int(MODEL["hidden_size"])
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02
    wp = native_linear.pack(w)
    head = screen.ScreenedHead.build(wp, n)
    flush = torch.ones(16 << 20)

    def fp32(h: torch.Tensor) -> torch.Tensor:
        return native_argmax.argmax(native_linear.linear(h, wp, n))

    def screened(h: torch.Tensor) -> torch.Tensor:
        return head.argmax(h)

    results: dict[str, Any] = {"threads": a.threads, "n": n, "k": k, "fp32_head_mb": round(wp.numel() * 4 / 1e6, 1),
                               "screen_extra_mb": round(head.nbytes / 1e6, 1), "rows": {}}
    print(f"LM head {n} x {k} fp32 ({results['fp32_head_mb']} MB; the screen adds {results['screen_extra_mb']} MB), "
          f"{a.threads} threads, {a.repeats} repeats, head evicted between calls")
    with torch.inference_mode():
        for m in (int(r) for r in a.rows.split(",")):
            for kind in ("random", "peaked"):
                hs = [hidden_rows(kind, w, m, g) for _ in range(4)]
                undecided = 0
                for h in hs:
                    got, want = screened(h), fp32(h)
                    decided = got >= 0
                    undecided += int((~decided).sum())
                    if not torch.equal(got[decided], want[decided]):
                        raise AssertionError(f"rows {m} {kind}: the screen picked a different token")
                times: dict[str, list[float]] = {"fp32": [], "screen": []}
                for i in range(a.repeats):
                    for name, fn in (("fp32", fp32), ("screen", screened)):
                        flush.sum()
                        t0 = time.perf_counter()
                        fn(hs[i % len(hs)])
                        times[name].append(time.perf_counter() - t0)
                row: dict[str, Any] = {f"{name}_ms": round(1e3 * statistics.median(t), 3) for name, t in times.items()}
                row["ratio_paired_median"] = round(statistics.median(
                    f / s for f, s in zip(times["fp32"], times["screen"], strict=True)), 2)
                row["undecided_rows"] = f"{undecided}/{m * len(hs)}"
                results["rows"][f"{m}/{kind}"] = row
                print(f"rows {m:>3} {kind:>6}: fp32 head + argmax {row['fp32_ms']:.2f} ms | screen "
                      f"{row['screen_ms']:.2f} ms | fp32/screen {row['ratio_paired_median']:.2f}x paired | "
                      f"undecided {row['undecided_rows']}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
