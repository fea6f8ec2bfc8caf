"""Property tests for quantize_kv / dequantize_kv (hypothesis) plus int4 packing and error paths."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pdcluster.kernels import dequantize_kv, pack_int4, quantize_kv, unpack_int4

QMAX = {8: 127, 4: 7}
F32_MAX = 2.0**127  # exact in fp32; headroom under FLT_MAX so code * scale cannot round up to inf


def vectors(min_abs: float = 0.0, max_abs: float = F32_MAX, max_len: int = 16):
    """Lists of finite fp32 floats with even length (int4 packs pairs)."""
    elem = st.floats(-max_abs, max_abs, width=32, allow_nan=False, allow_infinity=False)
    return st.integers(1, max_len // 2).flatmap(lambda n: st.lists(elem, min_size=2 * n, max_size=2 * n))


@settings(max_examples=150, deadline=None)
@given(xs=vectors(), bits=st.sampled_from([8, 4]))
def test_round_trip_within_half_step(xs, bits):
    x = torch.tensor(xs, dtype=torch.float32)
    absmax = x.abs().max().item()
    # The step (absmax / qmax) must itself be a normal float for "half a step" to be meaningful.
    assume(absmax == 0.0 or absmax >= 1e-35)
    q, scale = quantize_kv(x, bits=bits)
    back = dequantize_kv(q, scale, bits=bits)
    step = scale.item()
    assert step == pytest.approx(absmax / QMAX[bits], rel=1e-6)
    err = (back.double() - x.double()).abs().max().item()
    # Slack: fp32 rounding of x / scale (can flip a near-tie) and of code * scale, each ~1e-5 of a step.
    assert err <= 0.5 * step * (1 + 1e-4) + 1e-7 * absmax


@settings(max_examples=100, deadline=None)
@given(xs=vectors(), bits=st.sampled_from([8, 4]))
def test_never_nan_or_inf_and_codes_in_range(xs, bits):
    """Any finite input, subnormals included: finite scales and outputs, codes within [-qmax, qmax]."""
    x = torch.tensor(xs, dtype=torch.float32)
    q, scale = quantize_kv(x, bits=bits)
    back = dequantize_kv(q, scale, bits=bits)
    assert torch.isfinite(scale).all() and torch.isfinite(back).all()
    codes = q if bits == 8 else unpack_int4(q)
    assert codes.abs().max().item() <= QMAX[bits]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_zero_vectors(bits, dtype):
    x = torch.zeros(3, 5, 8, dtype=dtype)
    q, scale = quantize_kv(x, bits=bits)
    assert q.shape == ((3, 5, 8) if bits == 8 else (3, 5, 4))
    assert q.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert scale.dtype == torch.float32 and scale.shape == (3, 5)
    assert torch.equal(scale, torch.zeros(3, 5)) and not q.any()
    back = dequantize_kv(q, scale, bits=bits, dtype=dtype)
    assert back.dtype == dtype and torch.equal(back, x)


@settings(max_examples=30, deadline=None)
@given(c=st.floats(2.0**-100, F32_MAX, width=32), sign=st.sampled_from([1.0, -1.0]), bits=st.sampled_from([8, 4]))
def test_constant_vectors(c, sign, bits):
    x = torch.full((8,), sign * c, dtype=torch.float32)
    q, scale = quantize_kv(x, bits=bits)
    codes = q if bits == 8 else unpack_int4(q)
    assert torch.equal(codes, torch.full((8,), int(sign) * QMAX[bits], dtype=torch.int8))
    back = dequantize_kv(q, scale, bits=bits)
    assert ((back - x).abs() <= 1e-6 * x.abs()).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_extreme_magnitudes_mixed(bits):
    """Huge and tiny entries in one vector: tiny ones flush to 0, nothing overflows."""
    x = torch.tensor([[3e38, -1e-40, 1.0, -3e38], [1e-38, -1e-38, 0.0, 5e-39]], dtype=torch.float32)
    q, scale = quantize_kv(x, bits=bits)
    back = dequantize_kv(q, scale, bits=bits)
    assert torch.isfinite(back).all()
    assert back[0, 0].item() == pytest.approx(3e38, rel=1e-6)
    assert back[0, 2].item() == 0.0


@settings(max_examples=50, deadline=None)
@given(vals=st.lists(st.integers(-8, 7), min_size=2, max_size=32).filter(lambda v: len(v) % 2 == 0))
def test_pack_unpack_int4_round_trip(vals):
    codes = torch.tensor(vals, dtype=torch.int8)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (len(vals) // 2,)
    assert packed[0].item() & 0xF == vals[0] & 0xF  # low nibble = even index
    assert torch.equal(unpack_int4(packed), codes)


def test_round_to_nearest_even_on_ties():
    """Ties follow torch.round (half to even), the same rule the Triton write kernel uses."""
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5], dtype=torch.float32)  # scale exactly 1
    q, scale = quantize_kv(x, bits=8)
    assert scale.item() == 1.0
    assert q.tolist() == [127, 0, 2, 2, 0]


@pytest.mark.parametrize(
    ("call", "arg"),
    [
        (lambda: quantize_kv(torch.zeros(4), bits=3), "bits"),
        (lambda: quantize_kv(torch.zeros(4, dtype=torch.int32)), "x"),
        (lambda: quantize_kv(torch.zeros(3), bits=4), "q"),  # odd last dim cannot pack
        (lambda: dequantize_kv(torch.zeros(4, dtype=torch.uint8), torch.zeros(()), bits=8), "q"),
        (lambda: dequantize_kv(torch.zeros(4, dtype=torch.int8), torch.zeros(()), bits=4), "q"),
        (lambda: dequantize_kv(torch.zeros(2, 4, dtype=torch.int8), torch.zeros(3)), "scale"),
    ],
)
def test_errors_name_the_argument(call, arg):
    with pytest.raises(ValueError, match=rf"^{arg}\b"):
        call()
