"""The native CPU paged decode attention vs the engine's torch decode path, side by side in one process.

    python -m pdcluster.bench.native_attention [--threads 2] [--repeats 300] [--steps 60] [--json PATH]

1. One layer of decode attention at the benchmark model's shapes (8 heads over 4 KV heads, head_dim 64, fp32,
   block size 16): batch 1 at 190 positions and batch 16 at 160..220 positions (ragged, mean 190). Variants,
   interleaved call by call: the engine's torch path (``gather_kv`` by slot + SDPA with the step's additive
   bias; the slots and the bias are built once per step, so they are outside the timing, as in the engine)
   and the native kernel, each on ``--threads`` threads and on one thread. Also an int8 cache at batch 16,
   where the engine's torch path is ``paged_decode_attention`` (gather blocks, dequantize, two matmuls).
2. Whole decode steps of ``LLMEngine`` on engine_vs_hf's 56M Llama (``--prompt-len`` tokens, batch 1 and 16),
   native attention on and off alternating step by step (same requests, lengths within one token).
3. With ``--served``: two ``pdcluster serve`` processes of that model on 127.0.0.1, one with
   ``PDCLUSTER_NATIVE_ATTENTION=0`` (every other native kernel as in the first), the same prompts sent to
   each in turn (batch 1 and 16, streamed, 64 new tokens); decode tok/s as served_vs_hf measures it, tokens
   checked equal.

Reports medians (and p25) in microseconds/milliseconds and the ratio torch / native of the medians; the
machine is shared, so only ratios from one run mean anything. Needs a CPU with AVX-512 and a compiler.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 64, 16


def _summary(samples: dict[str, list[float]], unit: float) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for name, xs in samples.items():
        xs = sorted(xs)
        row[name] = {"median": round(statistics.median(xs) * unit, 2), "p25": round(xs[len(xs) // 4] * unit, 2)}
    return row


def _interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up (and the kernel's first-use build)
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return samples


def layer_case(lens: list[int], repeats: int, kv: str = "auto") -> dict[str, Any]:
    """One layer's decode attention for sequences of ``lens`` positions, the engine's torch path and the
    native kernel; ``kv`` "int8" times an int8 cache, whose torch path is ``paged_decode_attention``."""
    from pdcluster.kernels import paged_decode_attention
    from pdcluster.kernels.cpu import attention as cpu_attention
    from pdcluster.worker.engine.attention import gather_kv
    from pdcluster.worker.engine.kv_cache import PagedKVCache

    g = torch.Generator().manual_seed(0)
    nblk = [-(-n // BLOCK) for n in lens]
    cache = PagedKVCache(1, sum(nblk) + 8, BLOCK, KV_HEADS, HEAD_DIM, kv_dtype=kv)
    slots_all = torch.arange(cache.num_blocks * BLOCK)
    shape = (slots_all.numel(), KV_HEADS, HEAD_DIM)
    cache.write(0, torch.randn(shape, generator=g), torch.randn(shape, generator=g), slots_all)
    perm = torch.randperm(cache.num_blocks, generator=g).tolist()  # scattered blocks, as after churn
    width = max(nblk)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, n in enumerate(nblk):
        tables[i, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), HEADS, HEAD_DIM, generator=g)
    scale = HEAD_DIM**-0.5
    # what ModelRunner._prepare_decode builds once per step for the torch path
    pos = torch.arange(max(lens))
    slots = tables.long()[:, pos // BLOCK] * BLOCK + pos % BLOCK
    mask = (pos[None, :] < seq_lens[:, None])[:, None, None, :]
    bias = None if min(lens) == max(lens) else torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))

    def torch_path() -> torch.Tensor:
        if kv != "auto":  # the engine's path for quantized layers
            return paged_decode_attention(q, cache.k[0], cache.v[0], tables, seq_lens, scale=scale,
                                          k_scale=cache.k_scale[0], v_scale=cache.v_scale[0], backend="torch")
        k, v = gather_kv(cache, 0, slots)
        o = F.scaled_dot_product_attention(q.view(len(lens), HEADS, 1, HEAD_DIM), k.transpose(1, 2),
                                           v.transpose(1, 2), attn_mask=bias, scale=scale, enable_gqa=True)
        return o.view(len(lens), HEADS, HEAD_DIM)

    def one_thread(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                return fn()
            finally:
                torch.set_num_threads(threads)
        return run

    def native() -> torch.Tensor:
        return cpu_attention.paged_decode_attention_cpu(q, cache.k[0], cache.v[0], tables, seq_lens, scale=scale,
                                                        k_scale=cache.k_scale[0], v_scale=cache.v_scale[0])

    fns = {"torch": torch_path, "torch 1 thread": one_thread(torch_path), "native": native,
           "native 1 thread": one_thread(native)}
    ref = torch_path()
    for name in ("native", "native 1 thread"):
        torch.testing.assert_close(fns[name](), ref, atol=2e-5, rtol=1e-4)
    row = _summary(_interleaved(fns, repeats), 1e6)
    row["torch/native"] = {k: round(row[f"torch{k}"]["median"] / row[f"native{k}"]["median"], 2)
                           for k in ("", " 1 thread")}
    return row


def step_case(batch: int, prompt_len: int, steps: int) -> dict[str, Any]:
    """Decode steps of the engine with native attention on and off, alternating step by step."""
    from pdcluster.bench.engine_vs_hf import MODEL
    from pdcluster.worker.engine.attention import Attention
    from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine
    from pdcluster.worker.engine.sampling_params import SamplingParams
    from pdcluster.worker.local.demo_model import build_demo_model

    with tempfile.TemporaryDirectory(prefix="pdc-bench-") as tmp:
        folder = build_demo_model(Path(tmp), **MODEL)
        engine = LLMEngine(EngineConfig(model=str(folder), max_batch_size=16, max_batch_tokens=4096,
                                        enable_prefix_caching=False))
    layers = [m for m in engine.runner.model.modules() if isinstance(m, Attention)]  # type: ignore[union-attr]
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    for i in range(batch):
        engine.add_request(f"s-{i}", torch.randint(10, 32000, (prompt_len,), generator=g).tolist(), params)
    engine.step()  # prefill
    samples: dict[str, list[float]] = {"torch": [], "native": []}
    for i in range(steps):
        name = ("native", "torch")[i % 2]
        for m in layers:
            m.native_decode = name == "native"
        t0 = time.perf_counter()
        engine.step()
        samples[name].append(time.perf_counter() - t0)
    while engine.has_unfinished():
        engine.step()
    row = _summary(samples, 1e3)
    row["speedup"] = round(row["torch"]["median"] / row["native"]["median"], 2)
    # each torch step right after a native one, lengths one token apart: the ratio least moved by the load
    row["speedup_paired"] = round(statistics.median(
        t / n for n, t in zip(samples["native"], samples["torch"], strict=False)), 2)
    return row


def served_case(batches: list[int], repeats: int, threads: int, prompt_len: int) -> dict[str, Any]:
    """Decode tok/s of two servers, native attention on / off, interleaved request batch by batch."""
    import asyncio
    import socket

    from pdcluster.bench.engine_vs_hf import MODEL
    from pdcluster.bench.served_client import served_run
    from pdcluster.bench.served_vs_hf import start_server
    from pdcluster.kernels.cpu.attention import ENV_SWITCH
    from pdcluster.worker.local.demo_model import build_demo_model

    def free_port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pdc-bench-") as tmp:
        folder = build_demo_model(Path(tmp), **MODEL)
        ports = {"native": free_port(), "torch": free_port()}
        servers = []
        try:
            for name, port in ports.items():
                before = os.environ.get(ENV_SWITCH)
                os.environ[ENV_SWITCH] = "1" if name == "native" else "0"  # the child inherits it
                try:
                    servers.append(start_server(folder, port, threads, []))
                finally:
                    if before is None:
                        del os.environ[ENV_SWITCH]
                    else:
                        os.environ[ENV_SWITCH] = before
            g = torch.Generator().manual_seed(2)
            for batch in batches:
                samples: dict[str, list[float]] = {"native": [], "torch": []}
                for r in range(repeats + 1):  # the first round warms both up and is not counted
                    prompts = torch.randint(10, 32000, (batch, prompt_len), generator=g).tolist()
                    order = list(ports) if r % 2 else list(ports)[::-1]
                    ids = {}
                    for name in order:
                        _, decode, ids[name], _ = asyncio.run(served_run(ports[name], prompts, 64, True))
                        if r:
                            samples[name].append(decode)
                    assert ids["native"] == ids["torch"], "greedy tokens differ between the two servers"
                row = _summary(samples, 1.0)
                row["native/torch paired"] = round(statistics.median(
                    n / t for n, t in zip(samples["native"], samples["torch"], strict=True)), 2)
                row["samples"] = {k: [round(x, 1) for x in v] for k, v in samples.items()}
                out[str(batch)] = row
                print(f"served, batch {batch}: decode tok/s native {row['native']['median']} | torch "
                      f"{row['torch']['median']} | native/torch paired {row['native/torch paired']} | "
                      f"{row['samples']}", flush=True)
        finally:
            for proc in servers:
                proc.terminate()
                proc.wait(timeout=60)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=300, help="calls per variant, per layer case")
    ap.add_argument("--steps", type=int, default=120, help="decode steps per batch (half on, half off)")
    ap.add_argument("--prompt-len", type=int, default=190)
    ap.add_argument("--served", action="store_true", help="also two servers, native attention on / off")
    ap.add_argument("--served-repeats", type=int, default=5)
    ap.add_argument("--served-batches", default="1,16")
    ap.add_argument("--only-served", action="store_true", help="skip the layer and step parts")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from pdcluster.kernels.cpu import attention as cpu_attention

    if cpu_attention.module() is None:
        raise SystemExit("the native attention kernel is not available here (see the log line above)")
    spin = os.environ.get("GOMP_SPINCOUNT")
    print(f"threads {a.threads}, GOMP_SPINCOUNT={spin} (serve sets 2000 before torch loads; so does `make bench`)")
    out: dict[str, Any] = {"threads": a.threads, "gomp_spincount": spin, "layer_us": {}, "step_ms": {}}
    if a.served or a.only_served:
        batches = [int(b) for b in a.served_batches.split(",")]
        out["served_decode_tok_s"] = served_case(batches, a.served_repeats, a.threads, 128)
    if a.only_served:
        return out
    ragged = [160 + 4 * i for i in range(16)]
    cases = {"batch 1 @190": ([190], "auto"), "batch 16 @160..220": (ragged, "auto"),
             "int8 cache, batch 16 @160..220": (ragged, "int8")}
    for name, (lens, kv) in cases.items():
        out["layer_us"][name] = row = layer_case(lens, a.repeats, kv)
        print(f"layer, {name}: " + " | ".join(f"{k} {v['median']} us (p25 {v['p25']})" for k, v in row.items()
                                               if k != "torch/native") + f" | torch/native {row['torch/native']}")
    for batch in (1, 16):
        out["step_ms"][batch] = row = step_case(batch, a.prompt_len, a.steps)
        print(f"step, batch {batch}: torch {row['torch']['median']} ms (p25 {row['torch']['p25']}) | native "
              f"{row['native']['median']} ms (p25 {row['native']['p25']}) | torch/native {row['speedup']}, "
              f"paired {row['speedup_paired']}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
