"""The native fp32 RMSNorm (kernels/cpu/norm.cpp), alone and fused with the residual add, against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdcluster.kernels.cpu import native, step
from pdcluster.kernels.cpu import norm as N

needs_kernel = pytest.mark.skipif(native.unavailable_reason() is not None,
                                  reason=f"native kernels unavailable here: {native.unavailable_reason()}")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 16, 130])
@pytest.mark.parametrize("d", [1, 15, 16, 17, 64, 512, 1000])
def test_matches_torch(rows: int, d: int) -> None:
    g = torch.Generator().manual_seed(rows * 7 + d)
    x, r, w = (torch.randn(rows, d, generator=g) * 3 for _ in range(3))
    w = w[0]
    y, s = N.rms_norm(x, w, 1e-6) or (None, None)
    assert s is None and y is not None
    torch.testing.assert_close(y, F.rms_norm(x, (d,), w, 1e-6), rtol=2e-6, atol=2e-6)
    done = N.rms_norm(x, w, 1e-5, r)
    assert done is not None and done[1] is not None
    assert torch.equal(done[1], r + x)  # the add rounds exactly as torch's
    torch.testing.assert_close(done[0], F.rms_norm(r + x, (d,), w, 1e-5), rtol=2e-6, atol=2e-6)
    assert torch.equal(x, x.clone()) and done[1].data_ptr() not in (x.data_ptr(), r.data_ptr())  # inputs kept


@needs_kernel
def test_strided_rows_and_zero_rows() -> None:
    wide = torch.randn(5, 96)
    x = wide[:, :64]  # row stride 96
    w = torch.rand(64)
    done = N.rms_norm(x, w, 1e-6)
    assert done is not None
    torch.testing.assert_close(done[0], F.rms_norm(x, (64,), w, 1e-6), rtol=2e-6, atol=2e-6)
    empty = N.rms_norm(torch.randn(0, 64), w, 1e-6)
    assert empty is not None and empty[0].shape == (0, 64)


@needs_kernel
def test_bad_shapes_are_clear_errors() -> None:
    mod = step.module()
    assert mod is not None
    with pytest.raises(RuntimeError, match="w: fp32"):
        mod.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6, None)
    with pytest.raises(RuntimeError, match="residual must have"):
        mod.rms_norm(torch.randn(2, 8), torch.randn(8), 1e-6, torch.randn(3, 8))


def test_falls_back_where_it_cannot_run(monkeypatch) -> None:
    w = torch.ones(8)
    assert N.rms_norm(torch.randn(2, 8, dtype=torch.float16), w, 1e-6) is None
    assert N.rms_norm(torch.randn(2, 2, 8), w, 1e-6) is None  # callers flatten to rows first
    assert N.rms_norm(torch.randn(2, 8), w, 1e-6, torch.randn(3, 8)) is None
    assert N.rms_norm(torch.randn(8, 2).t(), torch.ones(8), 1e-6) is None  # columns not unit-stride
    monkeypatch.setenv(N.ENV_SWITCH, "0")
    assert N.rms_norm(torch.randn(2, 8), w, 1e-6) is None
