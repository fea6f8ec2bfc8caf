"""The native CPU paged decode attention (kernels/cpu/attention.cpp) against the torch paths.

Oracles: the float64 naive walk of conftest.py (small cases), the torch reference ``paged_decode_attention``
(backend="torch": the same layouts, long ragged batches) and the engine's own gather + SDPA / eager path for
what the reference cannot express (sliding window, soft-capping).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from pdcluster.kernels import paged_decode_attention
from pdcluster.kernels.cpu import attention as cpu_attn
from pdcluster.kernels.cpu import native
from pdcluster.worker.engine.attention import eager_attention, window_slots
from tests.native_marks import needs_native

pytestmark = needs_native

TOL = {None: dict(atol=2e-5, rtol=1e-4), 8: dict(atol=1e-4, rtol=1e-4), 4: dict(atol=1e-4, rtol=1e-4)}


def kernel(paged, q, **kw):
    return cpu_attn.paged_decode_attention_cpu(
        q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, k_scale=paged.k_scale,
        v_scale=paged.v_scale, **kw)


def reference(paged, q, scale):
    return paged_decode_attention(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens,
                                  scale=scale, k_scale=paged.k_scale, v_scale=paged.v_scale, backend="torch")


@pytest.mark.parametrize(("group", "head_dim", "block_size"),
                         list(itertools.product([1, 2, 4, 8], [64, 128], [16, 32])))
def test_fp32_ragged_matches_the_torch_reference(oracle, group, head_dim, block_size):
    lens = [1, 5, block_size - 1, block_size, block_size + 1, 190, 333, 600]
    paged = oracle.make_paged(lens, 2, head_dim, block_size, torch.float32, seed=group * 7 + head_dim + block_size)
    q = torch.randn(len(lens), 2 * group, head_dim)
    scale = head_dim**-0.5
    out = kernel(paged, q, scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, reference(paged, q, scale), **TOL[None])


@pytest.mark.parametrize(("cache_dtype", "bits", "head_dim"), [
    (torch.float32, None, 80),  # a head dim that is not a multiple of 16: the masked tail
    (torch.float16, None, 64), (torch.bfloat16, None, 128),
    (torch.float32, 8, 64), (torch.float32, 8, 48), (torch.float32, 4, 64), (torch.float32, 4, 128),
])
def test_every_cache_format_matches_the_naive_oracle(oracle, cache_dtype, bits, head_dim):
    lens = [1, 17, 40, 129, 0]
    paged = oracle.make_paged(lens, 2, head_dim, 16, cache_dtype, bits=bits, seed=head_dim)
    q = torch.randn(len(lens), 4, head_dim)
    out = kernel(paged, q, scale=0.1)
    ref = oracle.attention(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, scale=0.1,
                           k_scale=paged.k_scale, v_scale=paged.v_scale)
    tol = TOL[bits] if cache_dtype == torch.float32 else dict(atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(out.double(), ref, **tol)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # seq_len 0: a zero row


def gathered(paged, slots):
    """K/V at ``slots [seqs, L]`` as [seqs, kv_heads, L, d] (the engine's gather, float caches)."""
    kvh, d = paged.k_cache.shape[2], paged.k_cache.shape[3]
    k = paged.k_cache.reshape(-1, kvh, d)[slots.reshape(-1)].view(*slots.shape, kvh, d).transpose(1, 2)
    v = paged.v_cache.reshape(-1, kvh, d)[slots.reshape(-1)].view(*slots.shape, kvh, d).transpose(1, 2)
    return k, v


@pytest.mark.parametrize(("window", "block_size"), [(1, 16), (7, 16), (32, 32), (100, 16), (4096, 16)])
def test_sliding_window_matches_the_engine_gather(oracle, window, block_size):
    lens = [1, 6, 7, 8, 31, 33, 150, 421]
    paged = oracle.make_paged(lens, 2, 64, block_size, torch.float32, seed=window)
    q = torch.randn(len(lens), 4, 64)
    slots, mask = window_slots(paged.block_tables.clamp(min=0), paged.seq_lens, window, block_size)
    k, v = gathered(paged, slots)
    ref = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, scale=0.125, enable_gqa=True)
    out = kernel(paged, q, scale=0.125, window=window)
    torch.testing.assert_close(out, ref[:, :, 0], **TOL[None])


@pytest.mark.parametrize("window", [None, 50])
def test_softcap_matches_eager_attention(oracle, window):
    lens = [3, 64, 200]
    paged = oracle.make_paged(lens, 2, 64, 16, torch.float32, seed=3)
    q = torch.randn(len(lens), 8, 64) * 3  # large scores: the cap bites
    slots, mask = window_slots(paged.block_tables.clamp(min=0), paged.seq_lens, window or 10**6, 16)
    k, v = gathered(paged, slots)
    ref = eager_attention(q[:, :, None], k, v, mask, 0.125, 30.0)[:, :, 0]
    out = kernel(paged, q, scale=0.125, window=window, softcap=30.0)
    torch.testing.assert_close(out, ref, **TOL[None])


def test_threads_give_the_same_bits(oracle):
    paged = oracle.make_paged([190, 7, 600, 64], 4, 64, 16, torch.float32, seed=11)
    q = torch.randn(4, 8, 64)
    serial = kernel(paged, q, scale=0.125, parallel_min=1 << 62)
    assert torch.equal(kernel(paged, q, scale=0.125, parallel_min=0), serial)


def test_bf16_query_comes_back_in_its_dtype(oracle):
    paged = oracle.make_paged([20, 45], 2, 64, 16, torch.bfloat16, seed=5)
    q = torch.randn(2, 4, 64).to(torch.bfloat16)
    out = kernel(paged, q, scale=0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference(paged, q.float(), 0.125), atol=2e-2, rtol=2e-2)


def test_bad_tables_and_lengths_raise_instead_of_reading_out_of_bounds(oracle):
    paged = oracle.make_paged([20, 45], 2, 64, 16, torch.float32, seed=5)
    q = torch.randn(2, 4, 64)
    bad = paged.block_tables.clone()
    bad[1, 1] = paged.k_cache.shape[0]  # one past the pool
    with pytest.raises(RuntimeError, match="not a block of the cache"):
        cpu_attn.paged_decode_attention_cpu(q, paged.k_cache, paged.v_cache, bad, paged.seq_lens, scale=1.0)
    bad[1, 1] = -1
    with pytest.raises(RuntimeError, match="not a block of the cache"):
        cpu_attn.paged_decode_attention_cpu(q, paged.k_cache, paged.v_cache, bad, paged.seq_lens, scale=1.0)
    too_long = torch.tensor([20, 16 * paged.block_tables.shape[1] + 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="outside"):
        cpu_attn.paged_decode_attention_cpu(q, paged.k_cache, paged.v_cache, paged.block_tables, too_long,
                                            scale=1.0)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        cpu_attn.paged_decode_attention_cpu(torch.randn(2, 3, 64), paged.k_cache, paged.v_cache,
                                            paged.block_tables, paged.seq_lens, scale=1.0)


def test_supports_only_what_the_kernel_reads():
    assert cpu_attn.supports(torch.zeros(2, 16, 2, 64), 64)
    assert cpu_attn.supports(torch.zeros(2, 16, 2, 32, dtype=torch.uint8), 64)
    assert not cpu_attn.supports(torch.zeros(2, 16, 2, 24, dtype=torch.uint8), 48)  # int4 needs d % 32
    assert not cpu_attn.supports(torch.zeros(2, 16, 2, 64, dtype=torch.float64), 64)
    assert not cpu_attn.supports(torch.zeros(2, 2, 16, 64).transpose(1, 2), 64)  # not contiguous


def test_its_own_switch_turns_only_it_off(monkeypatch):
    cache = torch.zeros(2, 16, 2, 64)
    assert cpu_attn.available(cache, 64)
    monkeypatch.setenv(native.ENV_SWITCH, "-attention")
    assert not cpu_attn.available(cache, 64)
    assert native.enabled("linear") and native.enabled("argmax")
