"""The bf16-screened greedy head (kernels/cpu/screen.cpp) gives exactly argmax(linear.cpp's logits), or -1
where it cannot decide; never a different token."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels.cpu import argmax as A
from pdcluster.kernels.cpu import linear as L
from pdcluster.kernels.cpu import native, screen, step
from tests.native_marks import needs_screen


def exact(h: torch.Tensor, wp: torch.Tensor, n: int) -> torch.Tensor:
    """What the engine's fp32 path picks: the packed kernel's logits, then the native argmax."""
    return A.argmax(L.linear(h, wp, n))


def head(w: torch.Tensor) -> screen.ScreenedHead:
    return screen.ScreenedHead.build(L.pack(w), w.shape[0])


def check(sh: screen.ScreenedHead, h: torch.Tensor) -> torch.Tensor:
    """The screen's answer: each decided row equals the exact argmax; returns the answer."""
    got = sh.argmax(h)
    want = exact(h, sh.wp, sh.n)
    decided = got >= 0
    assert torch.equal(got[decided], want[decided]), (got, want)
    return got


@needs_screen
@pytest.mark.parametrize(("n", "k", "m"), [(32000, 512, 1), (32000, 512, 16), (1000, 64, 7), (130, 33, 3),
                                           (64, 2, 1), (65, 1, 2), (151, 127, 13)])
def test_random_heads_decide_every_row_exactly(n: int, k: int, m: int) -> None:
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g) * 0.05
    sh = head(w)
    for scale in (1.0, 20.0, 1e-3):
        got = check(sh, torch.randn(m, k, generator=g) * scale)
        assert bool((got >= 0).all()), "a random row should need no fallback"


@needs_screen
def test_trained_like_hidden_states_decide_exactly() -> None:
    # A hidden state close to one row of the head (an LM's confident step): a clear winner among near misses
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4096, 256, generator=g) / 16
    sh = head(w)
    picks = torch.randint(0, 4096, (16,), generator=g)
    h = w[picks] * 8 + torch.randn(16, 256, generator=g) * 0.05
    got = check(sh, h)
    assert torch.equal(got, picks)


@needs_screen
def test_near_ties_and_duplicate_rows_pick_the_first_maximum() -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(300, 96, generator=g)
    w[200] = w[17]  # an exact tie between two tokens: the first one wins, as argmax picks it
    w[250] = w[40] * (1 + 2**-20)  # a near tie below bf16's resolution: the fp32 logits decide it
    sh = head(w)
    h = torch.stack([w[17] * 3, w[40] * 3, -w[40] * 3, torch.randn(96, generator=g)])
    got = check(sh, h)
    assert got[0].item() == 17
    assert got[1].item() in (40, 250)


@needs_screen
def test_undecidable_rows_say_so() -> None:
    g = torch.Generator().manual_seed(9)
    w = torch.randn(500, 40, generator=g)
    sh = head(w)
    h = torch.randn(5, 40, generator=g)
    h[0] = 0.0  # every logit ties: more candidates than the screen settles
    h[1, 3] = float("nan")
    h[2, 7] = float("inf")
    h[3] = 3e38  # finite hidden, logits overflow to inf
    got = check(sh, h)
    assert got[:4].tolist() == [-1, -1, -1, -1]
    assert got[4].item() == exact(h[4:], sh.wp, sh.n).item()
    assert sh.argmax(h[:1], max_candidates=1000).item() == 0  # enough room: the first of the tied tokens


@needs_screen
def test_many_rows_and_empty_batches() -> None:
    g = torch.Generator().manual_seed(11)
    w = torch.randn(2000, 128, generator=g) * 0.1
    sh = head(w)
    check(sh, torch.randn(67, 128, generator=g))
    assert sh.argmax(torch.empty(0, 128)).shape == (0,)
    assert sh.nbytes == 32 * 64 * 128 * 2 + 2 * 2000 * 4  # panels padded to 64 rows


@needs_screen
def test_bad_input_is_a_clear_error() -> None:
    mod = step.module()
    assert mod is not None
    w = torch.randn(100, 32)
    sh = head(w)
    with pytest.raises(RuntimeError, match="for this K"):
        mod.screen_argmax(torch.randn(2, 31), sh.wb, sh.coef, sh.wp, sh.n, 64, 16)
    with pytest.raises(RuntimeError, match="fp32"):
        mod.screen_argmax(torch.randn(2, 32, dtype=torch.float64), sh.wb, sh.coef, sh.wp, sh.n, 64, 16)
    with pytest.raises(RuntimeError, match="coef"):
        mod.screen_argmax(torch.randn(2, 32), sh.wb, sh.coef[:, :50], sh.wp, sh.n, 64, 16)
    with pytest.raises(RuntimeError, match="w:"):
        mod.screen_pack(torch.randn(3, 4, 5))


def test_off_switch_and_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.ENV_SWITCH, "-screen")
    assert screen.unavailable_reason() == f"{native.ENV_SWITCH} turns it off"


@needs_screen
def test_the_dot_rate_probe_measures_this_core() -> None:
    mod = step.module()
    assert mod is not None
    ratios = [mod.bf16_dot_rate_ratio(20000) for _ in range(2)]
    # a rate ratio, not a constant: positive and finite, within what any core could do (the dot product
    # retires at most ~2x and at least ~1/8 as often as the FMA on every AVX512-BF16 core known)
    assert all(0.05 < r < 4.0 for r in ratios), ratios
    with pytest.raises(RuntimeError, match="iters"):
        mod.bf16_dot_rate_ratio(0)
    assert screen.dot_rate_ratio() == screen.dot_rate_ratio(), "probed once per process"


@pytest.mark.parametrize(("ratio", "rows"), [(1.0, screen.FAST_DOT_MAX_ROWS), (0.75, screen.FAST_DOT_MAX_ROWS),
                                             (0.25, screen.SLOW_DOT_MAX_ROWS), (None, screen.SLOW_DOT_MAX_ROWS)])
def test_the_row_limit_follows_the_probe(monkeypatch: pytest.MonkeyPatch, ratio: float | None, rows: int) -> None:
    monkeypatch.setattr(screen, "dot_rate_ratio", lambda: ratio)
    assert screen.max_rows() == rows
