"""The native RMSNorm (kernels/cpu/norm.cpp): F.rms_norm's exact bits, fused with the residual add, and the
model's use of it (layers.RMSNorm, the decoder's residual stream) keeping the same logits as the torch ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdcluster.kernels.cpu import native, step
from pdcluster.kernels.cpu import norm as N
from pdcluster.worker.engine.layers import RMSNorm
from tests.native_marks import needs_native

# widths of real models (Llama 512..8192, Qwen 896/1536/3584, Gemma 2304/2560, Phi 3072, Mixtral 4096, 5120)
# and odd ones: the cascade of torch's sum folds at 16-vector groups, so wide rows take other code paths
WIDTHS = [8, 9, 64, 100, 512, 896, 1024, 1376, 1536, 2304, 3584, 5120, 8192, 16384]


@needs_native
@pytest.mark.parametrize("hidden", WIDTHS)
def test_bits_equal_torch(hidden: int) -> None:
    mod = step.module()
    assert mod is not None
    g = torch.Generator().manual_seed(hidden)
    for rows, scale in ((1, 1.0), (16, 1e-4), (37, 50.0), (200, 1.0)):  # 200 rows: shared over the pool
        x = torch.randn(rows, hidden, generator=g) * scale
        d = torch.randn(rows, hidden, generator=g) * scale
        w = torch.randn(hidden, generator=g)
        for eps in (1e-6, 1e-5):
            s, y = mod.add_rms_norm(x, d, w, eps)
            assert torch.equal(s, x + d)
            assert torch.equal(y, F.rms_norm(x + d, (hidden,), w, eps)), (rows, scale, eps)
            same, y2 = mod.add_rms_norm(x, None, w, eps)
            assert same.data_ptr() == x.data_ptr() and torch.equal(y2, F.rms_norm(x, (hidden,), w, eps))
    assert N.trusted(hidden, 1e-6)


@needs_native
def test_zero_rows_and_special_values() -> None:
    mod = step.module()
    assert mod is not None
    w = torch.ones(512)
    s, y = mod.add_rms_norm(torch.empty(0, 512), None, w, 1e-6)
    assert y.shape == (0, 512)
    x = torch.zeros(3, 512)
    x[1, 7] = float("inf")
    x[2, 9] = float("nan")
    ref = F.rms_norm(x, (512,), w, 1e-6)
    assert torch.equal(mod.add_rms_norm(x, None, w, 1e-6)[1].isnan(), ref.isnan())
    assert torch.equal(torch.nan_to_num(mod.add_rms_norm(x, None, w, 1e-6)[1]), torch.nan_to_num(ref))


@needs_native
def test_bad_input_is_a_clear_error() -> None:
    mod = step.module()
    assert mod is not None
    with pytest.raises(RuntimeError, match="weight"):
        mod.add_rms_norm(torch.randn(2, 64), None, torch.ones(32), 1e-6)
    with pytest.raises(RuntimeError, match="delta"):
        mod.add_rms_norm(torch.randn(2, 64), torch.randn(3, 64), torch.ones(64), 1e-6)
    with pytest.raises(RuntimeError, match="x:"):
        mod.add_rms_norm(torch.randn(2, 64, dtype=torch.float64), None, torch.ones(64), 1e-6)
    with pytest.raises(RuntimeError, match="x:"):
        mod.add_rms_norm(torch.randn(64, 2).t(), None, torch.ones(64), 1e-6)


@needs_native
@pytest.mark.parametrize("native_on", ["1", "-norm"])
def test_module_matches_torch_ops(native_on: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """RMSNorm.forward / add_forward give the torch ops' bits with the kernel on and off; non-contiguous input
    and Gemma norms take torch's path."""
    monkeypatch.setenv(native.ENV_SWITCH, native_on)
    norm = RMSNorm(896, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(896))
    x, d = torch.randn(5, 896), torch.randn(5, 896)
    with torch.inference_mode():
        s, y = norm.add_forward(x, d)
        assert torch.equal(s, x + d) and torch.equal(y, F.rms_norm(x + d, (896,), norm.weight, 1e-6))
        assert torch.equal(norm(x), F.rms_norm(x, (896,), norm.weight, 1e-6))
        strided = torch.randn(896, 5).t()
        assert torch.equal(norm(strided), F.rms_norm(strided, (896,), norm.weight, 1e-6))
        gemma = RMSNorm(896, 1e-6, gemma=True)
        ref = (F.rms_norm(x, (896,), None, 1e-6) * (1.0 + gemma.weight)).type_as(x)
        assert torch.equal(gemma(x), ref)
    with torch.inference_mode():
        assert (norm._kernel(x) is not None) is (native_on == "1")
    assert N.kernel_for(norm.weight, 1e-6) is not None
    assert N.kernel_for(norm.weight.half(), 1e-6) is None


def test_narrow_rows_are_not_trusted_and_take_torch() -> None:
    """torch sums rows narrower than one 8-lane vector another way: the check sends them to torch."""
    assert not N.trusted(7, 1e-6)
    norm = RMSNorm(7, 1e-6)
    x = torch.randn(3, 7)
    with torch.inference_mode():
        assert torch.equal(norm(x), F.rms_norm(x, (7,), norm.weight, 1e-6))
