"""write_kv_cache (both backends) vs plain per-token assignment; quantized caches vs quantize_kv."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels import allocate_kv_cache, quantize_kv, write_kv_cache

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.triton)]
SENTINEL = 77


def _inputs(tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype, num_slots: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # k/v as strided slices of one fused [tokens, 2, kv_heads, head_dim] projection, as a model produces.
    kv = torch.randn(tokens, 2, kv_heads, head_dim, generator=g).to(dtype)
    k, v = kv[:, 0], kv[:, 1]
    k[1] = 0  # an all-zero vector must quantize without NaN
    slots = torch.randperm(num_slots, generator=g)[:tokens]
    slots[2] = -1  # padding
    return k, v, slots


def _fill(cache: tuple) -> tuple:
    for t in cache:
        if t is not None:
            t.fill_(SENTINEL)
    return cache


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_float_cache_scatter(backend, dtype):
    if backend == "triton" and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter truncates fp32->bf16 casts; bf16 is checked on CUDA by benchmarks/kernels.py")
    num_blocks, block_size, kv_heads, head_dim = 6, 8, 2, 32
    k, v, slots = _inputs(11, kv_heads, head_dim, torch.float32, num_blocks * block_size)
    kc, vc, ks, vs = _fill(allocate_kv_cache(num_blocks, block_size, kv_heads, head_dim, "auto", dtype))
    write_kv_cache(k, v, kc, vc, slots, backend=backend)
    expect_k = torch.full_like(kc, SENTINEL)
    expect_v = torch.full_like(vc, SENTINEL)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect_k[slot // block_size, slot % block_size] = k[t].to(dtype)
            expect_v[slot // block_size, slot % block_size] = v[t].to(dtype)
    assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantized_cache_matches_quantize_kv(backend, kv_dtype, dtype):
    """Codes and scales are exactly quantize_kv's, so either backend's cache reads the same."""
    bits = 8 if kv_dtype == "int8" else 4
    num_blocks, block_size, kv_heads, head_dim = 4, 16, 2, 64
    k, v, slots = _inputs(9, kv_heads, head_dim, dtype, num_blocks * block_size, seed=bits)
    kc, vc, ks, vs = _fill(allocate_kv_cache(num_blocks, block_size, kv_heads, head_dim, kv_dtype))
    write_kv_cache(k, v, kc, vc, slots, k_scale=ks, v_scale=vs, backend=backend)
    for t, slot in enumerate(slots.tolist()):
        blk, off = divmod(slot, block_size)
        if slot < 0:
            continue
        for x, cache, scale in ((k[t], kc, ks), (v[t], vc, vs)):
            codes, s = quantize_kv(x, bits=bits)
            assert torch.equal(cache[blk, off], codes), (t, slot)
            assert torch.equal(scale[blk, off], s), (t, slot)
    written = {s for s in slots.tolist() if s >= 0}
    for slot in range(num_blocks * block_size):
        if slot not in written:
            blk, off = divmod(slot, block_size)
            assert (kc[blk, off] == SENTINEL).all() and (ks[blk, off] == SENTINEL).all()


@pytest.mark.triton
def test_backends_agree_on_strided_cache():
    """A heads-major pool viewed as [blocks, block_size, kv_heads, d]: both backends write the same bytes."""
    caches = []
    k, v, slots = _inputs(7, 2, 32, torch.float32, 3 * 8, seed=5)
    for backend in ("torch", "triton"):
        pool = torch.zeros(2, 3, 2, 8, 32, dtype=torch.int8)  # [k/v, blocks, heads, block_size, d]
        kc, vc = pool[0].permute(0, 2, 1, 3), pool[1].permute(0, 2, 1, 3)
        ks, vs = torch.zeros(3, 8, 2), torch.zeros(3, 8, 2)
        write_kv_cache(k, v, kc, vc, slots, k_scale=ks, v_scale=vs, backend=backend)
        caches.append((pool, ks, vs))
    for a, b in zip(caches[0], caches[1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_padding_and_empty_are_noops(backend):
    kc, vc, _, _ = allocate_kv_cache(2, 8, 1, 32, "auto", torch.float32)
    k = torch.randn(3, 1, 32)
    write_kv_cache(k, k, kc, vc, torch.full((3,), -1, dtype=torch.int64), backend=backend)
    write_kv_cache(k[:0], k[:0], kc, vc, torch.zeros(0, dtype=torch.int32), backend=backend)
    assert not kc.any() and not vc.any()
