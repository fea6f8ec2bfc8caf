"""The native packed fp32 linear vs MKL, side by side in one process, on the 56M benchmark model's matrices.

    python -m pdcluster.bench.native_linear [--threads 2] [--rows 1,16,64,128,256] [--repeats 15] [--json PATH]

Kernel (kernels/cpu/linear.cpp, wrapper kernels/cpu/linear.py), reference and benchmark together: every
variant is first checked against ``F.linear`` (allclose, tolerance scaled by K), then the 33 projections of a
decode step (8 layers x fused QKV, O, fused gate/up, down; plus the 512 x 32000 LM head) are timed as one
set, variants interleaved repeat by repeat:

- ``mkl``: ``F.linear`` on column-major weights (the engine's torch path, cpu_layout.py),
- ``mkl_packed``: MKL's batched GEMM straight from the panels (the engine's path above the kernel's rows),
- ``kernel``: the packed kernel as the engine runs it (shared over the step's pool in items of at least
  ``linear.MIN_TASK_MACS`` multiply-adds),
- ``kernel_1t``: the packed kernel in the calling thread only,
- ``kernel_nt``: the packed kernel shared panel by panel over ``--threads`` threads (``kernels/cpu/pool.h``).

Reported per row count M: median ms, GB/s of weights streamed and % of the read bandwidth measured in the
same run (``served_vs_hf.read_bandwidth``, same threads), GFLOP/s, and mkl / kernel ratios; plus per-matrix
medians at M = 1 and 16. The box is shared: only ratios from one run mean anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pdcluster.bench.engine_vs_hf import MODEL


def model_shapes() -> list[tuple[str, int, int]]:
    """(name, N, K) of every projection a decode step runs, in step order."""
    h, inter = int(MODEL["hidden_size"]), int(MODEL["intermediate_size"])
    heads, kv = int(MODEL["num_attention_heads"]), int(MODEL["num_key_value_heads"])
    d = h // heads
    layer = [("qkv", (heads + 2 * kv) * d, h), ("o", h, heads * d), ("gate_up", 2 * inter, h), ("down", h, inter)]
    return [s for _ in range(int(MODEL["num_hidden_layers"])) for s in layer] + [("lm_head", int(MODEL["vocab_size"]), h)]


def variants(weights: list[torch.Tensor], xs: list[torch.Tensor]) -> dict[str, Callable[[], Any]]:
    from pdcluster.kernels.cpu import linear as L

    cm = [w.t().contiguous().t() for w in weights]
    wps = [L.pack(w) for w in weights]
    ns = [w.shape[0] for w in weights]
    return {
        "mkl": lambda: [F.linear(x, w) for x, w in zip(xs, cm, strict=True)],
        "mkl_packed": lambda: [L.mkl_packed(x, wp, n) for x, wp, n in zip(xs, wps, ns, strict=True)],
        "kernel": lambda: [L.linear(x, wp, n) for x, wp, n in zip(xs, wps, ns, strict=True)],
        "kernel_1t": lambda: [L.linear(x, wp, n, panels_per_task=0) for x, wp, n in zip(xs, wps, ns, strict=True)],
        "kernel_nt": lambda: [L.linear(x, wp, n, panels_per_task=1) for x, wp, n in zip(xs, wps, ns, strict=True)],
    }


def check(fns: dict[str, Callable[[], Any]]) -> None:
    """Every variant's outputs equal MKL's up to fp32 summation order."""
    ref = fns["mkl"]()
    for name, fn in fns.items():
        for got, want in zip(fn(), ref, strict=True):
            k_tol = 1e-6 * (want.abs().max().item() + 1) * 8
            torch.testing.assert_close(got, want, atol=k_tol, rtol=1e-4, msg=name)


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from pdcluster.bench.served_vs_hf import read_bandwidth
    from pdcluster.kernels.cpu import linear as L

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,16,64,128,256")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if L.module() is None:
        raise SystemExit("the native linear kernel is unavailable here (see the log line above)")
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    shapes = model_shapes()
    weights = [torch.randn(n, k) * k**-0.5 for _, n, k in shapes]
    nbytes = sum(w.numel() * 4 for w in weights)
    bw = read_bandwidth(a.threads)
    out: dict[str, Any] = {"threads": a.threads, "read_gb_s": round(bw / 1e9, 2), "weights_mb": round(nbytes / 1e6, 1),
                           "roofline_ms": round(nbytes / bw * 1e3, 2), "sets": {}, "per_matrix": {}}
    print(f"{len(shapes)} matrices, {nbytes / 1e6:.0f} MB fp32, {a.threads} threads; read bandwidth {bw / 1e9:.1f} GB/s "
          f"-> streaming the set once takes {nbytes / bw * 1e3:.2f} ms at best")
    with torch.inference_mode():
        for m in (int(r) for r in a.rows.split(",")):
            xs = [torch.randn(m, k) for _, _, k in shapes]
            fns = variants(weights, xs)
            check(fns)
            med = interleaved(fns, a.repeats)
            flop = 2 * m * nbytes / 4
            row: dict[str, Any] = {name: {"ms": round(t * 1e3, 2), "gb_s": round(nbytes / t / 1e9, 1),
                          "pct_read_bw": round(100 * nbytes / t / bw, 1), "gflop_s": round(flop / t / 1e9, 1)}
                   for name, t in med.items()}
            row["mkl_over_kernel"] = round(med["mkl"] / med["kernel"], 2)
            row["mkl_over_kernel_1t"] = round(med["mkl"] / med["kernel_1t"], 2)
            out["sets"][m] = row
            print(f"M={m:4d} " + "  ".join(f"{n} {r['ms']:7.2f} ms ({r['gb_s']:5.1f} GB/s {r['pct_read_bw']:5.1f} %, "
                                          f"{r['gflop_s']:6.1f} GFLOP/s)" for n, r in row.items() if isinstance(r, dict))
                  + f"  mkl/kernel {row['mkl_over_kernel']}x, mkl/kernel_1t {row['mkl_over_kernel_1t']}x", flush=True)
            if m in (1, 16):
                out["per_matrix"][m] = _per_matrix(shapes, weights, xs, a.repeats)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return out


def _per_matrix(shapes: list[tuple[str, int, int]], weights: list[torch.Tensor], xs: list[torch.Tensor],
                repeats: int) -> dict[str, dict[str, float]]:
    """Median microseconds of each distinct (name, N, K), the three variants interleaved."""
    rows: dict[str, dict[str, float]] = {}
    for i, (name, n, k) in enumerate(shapes[:4] + shapes[-1:]):
        j = i if i < 4 else len(shapes) - 1
        med = interleaved(variants([weights[j]], [xs[j]]), repeats * 4)
        rows[f"{name} {n}x{k}"] = {v: round(t * 1e6, 1) for v, t in med.items()}
        print(f"  {name:8s} {n:6d}x{k:<5d} " + "  ".join(f"{v} {t * 1e6:8.1f} us" for v, t in med.items()), flush=True)
    return rows


if __name__ == "__main__":
    main()
