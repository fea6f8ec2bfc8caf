"""The native int8 KV (de)quantization against the torch path: the same bits, every shape and edge."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels.cpu import native, quant
from pdcluster.kernels.kv_quant import dequantize_kv, quantize_kv
from tests.native_marks import needs_native

pytestmark = needs_native


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 1, 5), (7, 3, 128), (33, 8, 64), (2, 4, 17), (3, 2, 48),
                                   (5, 1, 256), (64, 8, 128), (4, 31)])
def test_codes_scales_and_values_are_the_torch_paths_bits(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * torch.rand(shape[:-1], generator=g).unsqueeze(-1) * 50
    x.view(-1, shape[-1])[0] = 0.0  # an all-zero vector: scale 0, codes 0
    if x.view(-1, shape[-1]).shape[0] > 1:
        x.view(-1, shape[-1])[1] = -0.0  # negative zeros: the scale must be +0 as torch's abs gives
    got = quant.quantize8(x)
    assert got is not None
    q, s = got
    qr, sr = quantize_kv(x, bits=8)
    assert q.dtype == torch.int8 and q.shape == qr.shape and s.shape == sr.shape
    assert torch.equal(q, qr)
    assert torch.equal(s.view(torch.int32), sr.view(torch.int32))  # bit patterns, -0 vs +0 included
    back = quant.dequantize8(q, s)
    assert back is not None and torch.equal(back, dequantize_kv(qr, sr, 8, torch.float32))


def test_ties_round_to_even_and_clamp() -> None:
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 63.5, 64.5, -126.5, 1e-30, 3e38]])
    got = quant.quantize8(x)
    assert got is not None
    assert torch.equal(got[0], quantize_kv(x, bits=8)[0])
    tiny = torch.full((1, 8), 1e-45)  # absmax / 127 underflows to 0: codes 0, not a division by zero
    q, s = quant.quantize8(tiny) or (None, None)
    assert q is not None and s is not None
    assert torch.equal(q, quantize_kv(tiny, 8)[0]) and torch.equal(s, quantize_kv(tiny, 8)[1])


def test_non_contiguous_input_is_quantized_as_its_values() -> None:
    x = torch.randn(16, 4, 64)[:, ::2]  # a strided view, as a head range of an export can be
    got = quant.quantize8(x)
    assert got is not None and torch.equal(got[0], quantize_kv(x, 8)[0])


def test_what_the_kernel_does_not_take_goes_back_to_the_caller() -> None:
    assert quant.quantize8(torch.randn(4, 8, dtype=torch.float64)) is None
    assert quant.quantize8(torch.randn(4, 0)) is None
    q, s = quantize_kv(torch.randn(3, 8), 8)
    assert quant.dequantize8(q, s[:2]) is None  # scales that do not match the codes
    q4, s4 = quantize_kv(torch.randn(3, 8), 4)
    assert torch.equal(quant.dequantize(q4, s4, 4, torch.float32), dequantize_kv(q4, s4, 4, torch.float32))
    assert torch.equal(quant.dequantize(q, s, 8, torch.float16), dequantize_kv(q, s, 8, torch.float16))


def test_switched_off_means_the_torch_path(monkeypatch) -> None:
    monkeypatch.setattr(native, "_modules", {})
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert quant.quantize8(torch.randn(2, 8)) is None
    q, s = quantize_kv(torch.randn(2, 8), 8)
    assert torch.equal(quant.dequantize(q, s, 8, torch.float32), dequantize_kv(q, s, 8, torch.float32))


def test_its_own_switch_turns_only_it_off(monkeypatch) -> None:
    monkeypatch.setenv(native.ENV_SWITCH, "-quant")
    assert not quant.ready() and quant.quantize8(torch.randn(2, 8)) is None
    q, s = quantize_kv(torch.randn(2, 8), 8)
    assert quant.dequantize8(q, s) is None
