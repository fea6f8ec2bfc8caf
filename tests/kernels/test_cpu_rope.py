"""The native RoPE + KV cache write (kernels/cpu/rope.cpp): the torch ops' exact bits, the same cache contents
as index_copy_, and bad input refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels.cpu import native
from pdcluster.kernels.cpu import rope as R
from tests.native_marks import needs_native


def _torch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nh: int, nkv: int, kc: torch.Tensor,
           vc: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    d = qkv.shape[-1]
    qk = qkv[:, : nh + nkv]
    out = qk * cos + qk.roll(d // 2, -1) * sin
    kc.view(-1, nkv, d).index_copy_(0, slots, out[:, nh:])
    vc.view(-1, nkv, d).index_copy_(0, slots, qkv[:, nh + nkv :])
    return out


@needs_native
@pytest.mark.parametrize(("n", "nh", "nkv", "d"), [(1, 8, 4, 64), (16, 8, 4, 64), (3, 12, 2, 80), (7, 4, 4, 2),
                                                   (100, 32, 8, 128), (33, 14, 2, 64)])
def test_bits_and_cache_equal_torch(n: int, nh: int, nkv: int, d: int) -> None:
    g = torch.Generator().manual_seed(n * 1000 + d)
    qkv = torch.randn(n, nh + 2 * nkv, d, generator=g) * 10
    cos, sin = torch.randn(n, 1, d, generator=g), torch.randn(n, 1, d, generator=g)
    kc = torch.randn(8 + n, 16, nkv, d, generator=g)
    vc = torch.randn(8 + n, 16, nkv, d, generator=g)
    slots = torch.randperm(kc.shape[0] * 16, generator=g)[:n]
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref = _torch(qkv, cos, sin, nh, nkv, kc_ref, vc_ref, slots)
    kernel = R.kernel_for(kc, quantized=False)
    assert kernel is not None
    out = kernel(qkv, cos, sin, nh, nkv, kc, vc, slots)
    assert torch.equal(out, ref)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


@needs_native
def test_bad_input_writes_nothing() -> None:
    rope_write = R.kernel_for(torch.zeros(1, 16, 4, 64), quantized=False)
    assert rope_write is not None
    qkv, cos, sin = torch.randn(2, 16, 64), torch.randn(2, 1, 64), torch.randn(2, 1, 64)
    kc, vc = torch.zeros(4, 16, 4, 64), torch.zeros(4, 16, 4, 64)
    with pytest.raises(RuntimeError, match="outside the cache"):
        rope_write(qkv, cos, sin, 8, 4, kc, vc, torch.tensor([3, 64]))
    with pytest.raises(RuntimeError, match="outside the cache"):
        rope_write(qkv, cos, sin, 8, 4, kc, vc, torch.tensor([0, -1]))
    assert not kc.any() and not vc.any()
    with pytest.raises(RuntimeError, match="heads"):
        rope_write(qkv, cos, sin, 8, 3, kc, vc, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="cos/sin"):
        rope_write(qkv, cos[:1], sin, 8, 4, kc, vc, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="slots"):
        rope_write(qkv, cos, sin, 8, 4, kc, vc, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="k_cache"):
        rope_write(qkv, cos, sin, 8, 4, kc.half(), vc.half(), torch.tensor([0, 1]))


def test_no_kernel_off_the_fp32_cpu_path(monkeypatch: pytest.MonkeyPatch) -> None:
    assert R.kernel_for(torch.zeros(4, 16, 4, 64, dtype=torch.int8), quantized=True) is None
    assert R.kernel_for(torch.zeros(4, 16, 4, 64, dtype=torch.float16), quantized=False) is None
    assert R.kernel_for(torch.zeros(4, 16, 4, 64)[:, :, :2], quantized=False) is None  # not contiguous
    assert R.kernel_for(torch.zeros(4, 16, 4, 64), quantized=True) is None
    monkeypatch.setenv(native.ENV_SWITCH, "-rope")
    assert not native.enabled("rope") and native.enabled("norm")
