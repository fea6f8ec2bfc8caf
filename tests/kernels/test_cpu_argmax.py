"""The native greedy argmax (kernels/cpu/argmax.cpp) answers exactly as torch.argmax(dim=-1)."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels.cpu import argmax as A
from pdcluster.kernels.cpu import native, step
from tests.native_marks import needs_native


@needs_native
@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 31, 32000, 151936])
def test_matches_torch_on_random_rows(n: int) -> None:
    x = torch.randn(5, n, generator=torch.Generator().manual_seed(n))
    assert torch.equal(A.argmax(x), x.argmax(-1))


@needs_native
def test_ties_nan_and_infinities() -> None:
    x = torch.zeros(7, 40)
    x[0, [3, 20, 39]] = 5.0  # ties: the first index
    x[1] = float("-inf")  # all -inf: index 0
    x[2, 17], x[2, 33] = float("nan"), float("nan")  # the first NaN is the maximum
    x[2, 5] = float("inf")
    x[3, 39] = float("inf")
    x[4] = -0.0
    x[4, 9] = 0.0  # -0.0 == 0.0: the first of them
    x[5, 16], x[5, 32] = 1.0, 1.0  # ties across lanes of different vectors
    x[6, :] = torch.arange(40.0).flip(0)  # the maximum in the first lane
    assert torch.equal(A.argmax(x), x.argmax(-1))
    strided = torch.randn(6, 50)[:, :40]  # row stride 50
    assert torch.equal(A.argmax(strided), strided.argmax(-1))


@needs_native
def test_bad_input_is_a_clear_error() -> None:
    mod = step.module()
    assert mod is not None
    with pytest.raises(RuntimeError, match="1 .. 2"):
        mod.argmax_rows(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match="fp32"):
        mod.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))


def test_torch_path_where_the_kernel_cannot_take_it(monkeypatch) -> None:
    x64 = torch.randn(3, 10, dtype=torch.float64)
    assert torch.equal(A.argmax(x64), x64.argmax(-1))
    monkeypatch.setenv(native.ENV_SWITCH, "-argmax")
    x = torch.randn(3, 10)
    assert torch.equal(A.argmax(x), x.argmax(-1))
