"""The native packed fp32 linear (kernels/cpu/linear.cpp) against torch's F.linear, and its packing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdcluster.kernels.cpu import linear as L
from tests.native_marks import needs_native


def _tol(k: int) -> float:
    # |error| of an fp32 dot product of k terms grows ~ sqrt(k) * eps * |terms|; inputs are N(0, 1)
    return 8 * (k**0.5) * torch.finfo(torch.float32).eps * 4


def test_pack_roundtrip_and_rows() -> None:
    w = torch.randn(130, 7)
    wp = L.pack(w)
    assert wp.shape == (3, 7, 64) and wp.is_contiguous()
    assert torch.equal(L.unpack(wp, 130), w)
    assert torch.count_nonzero(wp[2, :, 2:]) == 0  # padding past N is zero
    ids = torch.tensor([0, 63, 64, 129, 5])
    assert torch.equal(L.rows(wp, ids), w[ids])
    assert torch.equal(L.pack(w.t().contiguous().t()), wp)  # column-major input packs the same


@needs_native
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 16, 17, 64])
@pytest.mark.parametrize("n,k", [(1, 1), (64, 512), (70, 33), (130, 1376), (2752, 512), (513, 77)])
def test_kernel_matches_torch(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    wp = L.pack(w)
    for bias in (None, b):
        got = L.linear(x, wp, n, bias)
        assert got.shape == (m, n) and got.dtype == torch.float32
        torch.testing.assert_close(got, F.linear(x, w, bias), atol=_tol(k), rtol=1e-5)


@needs_native
def test_kernel_is_row_order_independent_and_takes_strided_rows() -> None:
    """Each output is one ascending-k sum: a row gives the same bits alone or inside any batch."""
    torch.manual_seed(0)
    w, x = torch.randn(200, 96), torch.randn(16, 96)
    wp = L.pack(w)
    batch = L.linear(x, wp, 200)
    for i in (0, 5, 15):
        assert torch.equal(L.linear(x[i : i + 1], wp, 200), batch[i : i + 1])
    wide = torch.randn(16, 128)
    wide[:, :96] = x
    assert torch.equal(L.linear(wide[:, :96], wp, 200), batch)  # row stride 128, unit column stride
    assert torch.equal(L.linear(x, wp, 200, prefetch=False), batch)
    for per_task in (0, 1, 2):  # one thread, or panels split over the pool: same bits
        assert torch.equal(L.linear(x, wp, 200, panels_per_task=per_task), batch)


def test_threading_policy() -> None:
    # decode-sized products: ITEMS_PER_THREAD long items per thread, never smaller than min_task_macs
    assert L.grain(1, 512, 8, min_task_macs=1 << 22, threads=2) == 0  # 256K multiply-adds: one thread
    assert L.grain(16, 512, 50, min_task_macs=1 << 22, threads=2) == 13  # 4 items of 13 panels (> 8 x 512K)
    assert L.grain(16, 512, 50, min_task_macs=1 << 22, threads=8) == 8  # 16 items would hold < 4M each
    assert L.grain(1, 512, 500, min_task_macs=0, threads=2) == 125
    assert L.grain(16, 512, 43, min_task_macs=0, threads=2) == 11
    assert L.grain(6, 512, 3, min_task_macs=0, threads=2) == 1
    assert L.grain(16, 512, 4, min_task_macs=0, threads=1) == 2
    assert L.grain(4, 512, 2, min_task_macs=0, threads=1) == 1
    assert L.grain(0, 512, 500) == 0  # no rows: no division by zero
    assert L.grain(1, 512, 64, min_task_macs=0) == -(-64 // (L.ITEMS_PER_THREAD * torch.get_num_threads()))
    # prefill-sized products: small items, or panels // PREFETCH_ITEMS where there are many panels
    assert L.grain(64, 4096, 2, min_task_macs=1) == 1
    assert L.grain(64, 512, 500, min_task_macs=0) == 500 // L.PREFETCH_ITEMS
    assert L.grain(64, 512, 43, min_task_macs=0) == 1


@needs_native
def test_zero_rows() -> None:
    """A step can carry an empty chunk: zero rows in, zero rows out (this divided by zero once)."""
    wp = L.pack(torch.randn(100, 32))
    assert L.linear(torch.randn(0, 32), wp, 100).shape == (0, 100)
    assert L.linear(torch.randn(0, 32), wp, 100, torch.randn(100)).shape == (0, 100)


@needs_native
def test_bad_shapes_are_clear_errors() -> None:
    wp = L.pack(torch.randn(100, 32))
    with pytest.raises(RuntimeError, match="K=31"):
        L.linear(torch.randn(2, 31), wp, 100)
    with pytest.raises(RuntimeError, match="does not fit"):
        L.linear(torch.randn(2, 32), wp, 200)
    with pytest.raises(RuntimeError, match="fp32"):
        L.linear(torch.randn(2, 32, dtype=torch.float64), wp, 100)
    with pytest.raises(RuntimeError, match="bias"):
        L.linear(torch.randn(2, 32), wp, 100, torch.randn(99))
