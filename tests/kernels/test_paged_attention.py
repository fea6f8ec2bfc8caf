"""paged_decode_attention (both backends) vs the naive oracle in conftest.py.

The torch backend gets the full grid (it is cheap); the Triton backend, which runs under TRITON_INTERPRET=1 on
CPU, gets a smaller covering set so the suite stays fast.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from pdcluster.kernels import paged_decode_attention
from pdcluster.kernels.paged_attention import paged_decode_attention_triton
from pdcluster.kernels.validate import check_attention

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=4e-3, rtol=1e-2)}


def boundary_lens(block_size: int) -> list[int]:
    """seq_len 1 and off-by-one around block boundaries."""
    return [1, block_size - 1, block_size, block_size + 1, 2 * block_size - 1, 2 * block_size + 1]


def run(oracle, paged, q, backend, **kw):
    out = paged_decode_attention(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens,
                                 k_scale=paged.k_scale, v_scale=paged.v_scale, backend=backend, **kw)
    ref = oracle.attention(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens,
                           k_scale=paged.k_scale, v_scale=paged.v_scale, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    return out, ref


@pytest.mark.parametrize(("dtype", "group", "block_size"),
                         list(itertools.product([torch.float32, torch.float16], [1, 2, 4, 8], [8, 16, 32])))
def test_torch_float_grid(oracle, dtype, group, block_size):
    kv_heads, head_dim = 2, 32
    paged = oracle.make_paged(boundary_lens(block_size), kv_heads, head_dim, block_size, dtype,
                              seed=group * 100 + block_size)
    q = torch.randn(paged.seq_lens.numel(), kv_heads * group, head_dim).to(dtype)
    out, ref = run(oracle, paged, q, "torch")
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


# (dtype, group, block_size, head_dim, seq_lens): every value of each axis appears at least once.
TRITON_CASES = [
    (torch.float32, 1, 8, 32, [1, 7, 8, 9]),
    (torch.float32, 4, 16, 64, [1, 15, 16, 17]),
    (torch.float32, 8, 32, 32, [1, 31, 33]),
    (torch.float16, 2, 8, 64, [1, 8, 17]),
    (torch.float16, 4, 32, 32, [1, 32, 33]),
    (torch.float16, 8, 16, 128, [1, 16, 17]),
]


@pytest.mark.triton
@pytest.mark.parametrize(("dtype", "group", "block_size", "head_dim", "lens"), TRITON_CASES)
def test_triton_float_grid(oracle, dtype, group, block_size, head_dim, lens):
    paged = oracle.make_paged(lens, 2, head_dim, block_size, dtype, seed=block_size + group)
    q = torch.randn(len(lens), 2 * group, head_dim).to(dtype)
    out, ref = run(oracle, paged, q, "triton")
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


@pytest.mark.triton
@pytest.mark.parametrize(("bits", "partition"), [(None, 16), (8, 16), (4, 16), (None, 48)])
def test_triton_split_k_matches_torch(oracle, bits, partition):
    """Force several partitions (and a reduce) on a longer sequence; include an empty-tail partition."""
    lens = [70, 3, 0]
    paged = oracle.make_paged(lens, 1, 32, 8, torch.float32, bits=bits, seed=7, pad_table=3)
    q = torch.randn(3, 4, 32)  # MQA: 4 query heads on 1 kv head
    info = check_attention(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens,
                           paged.k_scale, paged.v_scale)
    out = paged_decode_attention_triton(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens,
                                        info, k_scale=paged.k_scale, v_scale=paged.v_scale,
                                        partition_size=partition, tile_n=16)
    ref = oracle.attention(q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens,
                           k_scale=paged.k_scale, v_scale=paged.v_scale)
    torch.testing.assert_close(out.double(), ref, **TOL[torch.float32])
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # seq_len 0 -> zeros


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantized_tight_vs_own_dequant_and_loose_vs_float(oracle, backend, bits, dtype):
    lens = [1, 15, 16, 33]
    paged = oracle.make_paged(lens, 2, 64, 16, dtype, bits=bits, seed=bits)
    q = torch.randn(len(lens), 4, 64).to(dtype)
    out, ref = run(oracle, paged, q, backend)
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])
    # Loose: against attention over the unquantized K/V (the values the cache was built from).
    fk, fv = allocate_float(oracle, paged, lens)
    ref_float = oracle.attention(q, fk, fv, paged.block_tables, paged.seq_lens)
    err = (out.double() - ref_float).abs().max().item()
    assert err < {8: 0.05, 4: 0.5}[bits]


def allocate_float(oracle, paged, lens):
    """Float32 caches with the same tables, holding the pre-quantization K/V."""
    nb, bs, kvh = paged.k_scale.shape
    d = paged.k_float[0].shape[-1]
    fk = torch.zeros(nb, bs, kvh, d)
    fv = torch.zeros(nb, bs, kvh, d)
    for i, n in enumerate(lens):
        for t in range(n):
            blk, off = int(paged.block_tables[i, t // bs]), t % bs
            fk[blk, off] = paged.k_float[i][t]
            fv[blk, off] = paged.v_float[i][t]
    return fk, fv


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_strided_inputs_and_custom_scale(oracle, backend):
    """Caches stored heads-major (permuted view) and q sliced out of a wider tensor."""
    lens = [5, 16, 17]
    paged = oracle.make_paged(lens, 2, 32, 8, torch.float32, transposed=True, seed=3)
    assert not paged.k_cache.is_contiguous()
    q = torch.randn(3, 8, 64)[:, :, ::2]
    out, ref = run(oracle, paged, q, backend, scale=0.3)
    torch.testing.assert_close(out.double(), ref, **TOL[torch.float32])


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_zero_len_rows_and_empty_batch(oracle, backend):
    paged = oracle.make_paged([0, 9], 1, 32, 8, torch.float32)
    q = torch.randn(2, 2, 32)
    out, ref = run(oracle, paged, q, backend)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out.double(), ref, **TOL[torch.float32])
    empty = paged_decode_attention(q[:0], paged.k_cache, paged.v_cache, paged.block_tables[:0],
                                   paged.seq_lens[:0], backend=backend)
    assert empty.shape == (0, 2, 32)


def test_torch_path_long_sequence_matches_oracle(oracle):
    """Thousands of tokens on the (cheap) torch path."""
    paged = oracle.make_paged([2050, 1], 1, 32, 32, torch.float32, seed=11)
    q = torch.randn(2, 8, 32)
    out, ref = run(oracle, paged, q, "torch")
    torch.testing.assert_close(out.double(), ref, **TOL[torch.float32])


def test_torch_path_bf16(oracle):
    """bf16 runs on the torch path anywhere (the interpreter's bf16 dot is wrong, so Triton bf16 is GPU-only)."""
    paged = oracle.make_paged([1, 16, 17], 2, 64, 16, torch.bfloat16, seed=21)
    q = torch.randn(3, 8, 64).to(torch.bfloat16)
    out, ref = run(oracle, paged, q, "torch")
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize(("q_dtype", "cache_dtype"), [(torch.float16, torch.float32), (torch.float32, torch.float16)])
def test_mixed_q_and_cache_dtypes(oracle, backend, q_dtype, cache_dtype):
    """Output is in q.dtype; math is at least as precise as the less precise of the two."""
    paged = oracle.make_paged([3, 9], 1, 32, 8, cache_dtype, seed=13)
    q = torch.randn(2, 2, 32).to(q_dtype)
    out, ref = run(oracle, paged, q, backend)
    torch.testing.assert_close(out.double(), ref, **TOL[torch.float16])


@pytest.mark.triton
@pytest.mark.parametrize(("head_dim", "block_size", "bits"), [(48, 12, None), (80, 8, 8), (40, 5, 4)])
def test_triton_non_power_of_two_head_dim_and_block_size(oracle, head_dim, block_size, bits):
    """head_dim is padded to a power of two inside the kernels; tiles run over tokens, so any block size."""
    from pdcluster.kernels import allocate_kv_cache, write_kv_cache

    lens = [1, block_size + 1, 3 * block_size]
    paged = oracle.make_paged(lens, 2, head_dim, block_size, torch.float32, bits=bits, seed=head_dim)
    q = torch.randn(3, 4, head_dim)
    out, ref = run(oracle, paged, q, "triton")
    torch.testing.assert_close(out.double(), ref, **TOL[torch.float32])
    # The write kernel pads the same way: both backends fill identical caches.
    kv_dtype = {None: "auto", 8: "int8", 4: "int4"}[bits]
    k, v = torch.randn(5, 2, head_dim), torch.randn(5, 2, head_dim)
    slots = torch.tensor([0, 3, -1, 2 * block_size, 1])
    filled = []
    for backend in ("torch", "triton"):
        c = allocate_kv_cache(4, block_size, 2, head_dim, kv_dtype, torch.float32)
        write_kv_cache(k, v, *c[:2], slots, k_scale=c[2], v_scale=c[3], backend=backend)
        filled.append(c)
    for a, b in zip(*filled, strict=True):
        assert a is None or torch.equal(a, b)
