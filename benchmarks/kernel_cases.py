"""Building blocks for benchmarks/kernels.py: sizes, timers, random paged caches, the correctness sweep.

Kept apart from the CLI so the unit test can drive the same code with tiny sizes on CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdcluster.kernels import allocate_kv_cache, kv_bits, paged_decode_attention, write_kv_cache


@dataclass(frozen=True)
class Sizes:
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    kv_dtypes: tuple[str, ...]
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    warmup: int
    min_iters: int
    copy_mib: int  # size of the tensor used to measure copy bandwidth


# The grid: batch 1/16/64, context 1k/8k/32k, head_dim 128, GQA 8:1, fp16 vs int8 vs int4.
GPU_SIZES = Sizes((1, 16, 64), (1024, 8192, 32768), ("auto", "int8", "int4"), 32, 4, 128, 16, 5, 20, 2048)
# Same code paths under TRITON_INTERPRET=1 on CPU, small enough for a unit test.
SMOKE_SIZES = Sizes((2,), (40,), ("auto", "int8", "int4"), 8, 2, 32, 8, 0, 1, 4)


def make_timer(device: torch.device) -> Callable[[Callable[[], object], int, int], float]:
    """Seconds per call: CUDA events on a GPU (device time, no host overhead), perf_counter on CPU."""

    def cuda_time(fn: Callable[[], object], warmup: int, min_iters: int) -> float:
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        one = start.elapsed_time(end) / 1e3
        # Enough iterations for ~50 ms of work, so fast configs are not dominated by event resolution.
        iters = max(min_iters, min(200, int(0.05 / max(one, 1e-6))))
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / iters

    def cpu_time(fn: Callable[[], object], warmup: int, min_iters: int) -> float:
        for _ in range(warmup):
            fn()
        t0 = time.perf_counter()
        for _ in range(min_iters):
            fn()
        return (time.perf_counter() - t0) / min_iters

    return cuda_time if device.type == "cuda" else cpu_time


def copy_bandwidth(device: torch.device, mib: int, timer) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write (the roofline for a streaming read)."""
    n = mib * 2**20 // 4
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src), 3, 10)
    return 2 * n * 4 / t


@dataclass
class Case:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


def random_case(batch: int, context: int, sizes: Sizes, kv_dtype: str, dtype: torch.dtype,
                device: torch.device, seed: int = 0) -> Case:
    """Every sequence at ``context`` tokens, blocks scattered over the pool by a random permutation."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    per_seq = -(-context // sizes.block_size)
    num_blocks = batch * per_seq
    kc, vc, ks, vs = allocate_kv_cache(num_blocks, sizes.block_size, sizes.kv_heads, sizes.head_dim, kv_dtype,
                                       dtype, device)
    bits = kv_bits(kv_dtype)
    for cache, scale in ((kc, ks), (vc, vs)):
        if bits is None:
            cache.normal_()
        else:
            # Random codes and realistic scales: the kernel's cost does not depend on the values.
            lo, hi = (-127, 128) if bits == 8 else (0, 256)
            cache.copy_(torch.randint(lo, hi, cache.shape, device=device, dtype=torch.int16).to(cache.dtype))
            scale.uniform_(0.005, 0.02)
    tables = torch.randperm(num_blocks, generator=g).view(batch, per_seq).to(torch.int32).to(device)
    q = torch.randn(batch, sizes.heads, sizes.head_dim, dtype=dtype, device=device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return Case(q, kc, vc, ks, vs, tables, lens)


TOL = {torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}


def correctness(device: torch.device, sizes: Sizes, dtypes: tuple[torch.dtype, ...]) -> list[dict]:
    """Triton vs the torch path on ``device``: attention (one-pass and forced split-K) and cache writes."""
    from pdcluster.kernels.paged_attention import paged_decode_attention_triton
    from pdcluster.kernels.validate import check_attention

    rows: list[dict] = []
    tokens = max(sizes.contexts[0], 3 * sizes.block_size + 1)
    for dtype in dtypes:
        for kv_dtype in sizes.kv_dtypes:
            # Cache writes: both backends must produce the same cache from the same new tokens.
            caches = []
            k = torch.randn(tokens, sizes.kv_heads, sizes.head_dim, dtype=dtype, device=device)
            v = torch.randn_like(k)
            slots = torch.randperm(tokens + sizes.block_size, device=device)[:tokens]
            slots[0] = -1
            nb = -(-(tokens + sizes.block_size) // sizes.block_size)
            for backend in ("torch", "triton"):
                c = allocate_kv_cache(nb, sizes.block_size, sizes.kv_heads, sizes.head_dim, kv_dtype, dtype, device)
                write_kv_cache(k, v, c[0], c[1], slots, k_scale=c[2], v_scale=c[3], backend=backend)
                caches.append(c)
            diff = max((a.to(torch.float32) - b.to(torch.float32)).abs().max().item()
                       for a, b in zip(caches[0], caches[1], strict=True) if a is not None)
            rows.append(dict(check="write_kv_cache", dtype=str(dtype), kv_dtype=kv_dtype, max_err=diff,
                             tol=0.0, ok=diff == 0.0))
            # Attention: ragged lengths (1, a block boundary, the longest context of the sweep).
            case = random_case(3, tokens, sizes, kv_dtype, dtype, device, seed=1)
            case.seq_lens.copy_(torch.tensor([1, sizes.block_size + 1, tokens], dtype=torch.int32))
            args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
            ref = paged_decode_attention(*args, k_scale=case.k_scale, v_scale=case.v_scale, backend="torch")
            info = check_attention(*args, case.k_scale, case.v_scale)
            for label, part in (("one-pass", None), ("split-K", 16 if device.type != "cuda" else 256)):
                tile = 16 if part == 16 else None
                out = paged_decode_attention_triton(*args, info, k_scale=case.k_scale, v_scale=case.v_scale,
                                                    partition_size=part, tile_n=tile)
                err = (out.float() - ref.float()).abs().max().item()
                rows.append(dict(check=f"attention {label}", dtype=str(dtype), kv_dtype=kv_dtype, max_err=err,
                                 tol=TOL[dtype], ok=err <= TOL[dtype]))
    return rows
