"""Greedy's LM head screened in bf16, decided in fp32 (``screen.cpp``): the token ``argmax(linear(h))`` gives,
bit for bit, at the cost of a bf16 product plus the fp32 logits of a few candidates.

``ScreenedHead.build(wp, n)`` makes the bf16 panels and error coefficients of an LM head once (half its
bytes again, in memory); ``head.argmax(h)`` answers each row, -1 where the kernel could not decide (a
non-finite value, a near-tie across many tokens): the caller runs the fp32 head for those rows. Runs where
the native module loads and the CPU has AVX512-BF16; ``PDCLUSTER_NATIVE_KERNELS=-screen`` turns it off alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pdcluster.kernels.cpu import linear as native_linear
from pdcluster.kernels.cpu import native, step

CPU_FLAG = "avx512_bf16"  # VDPBF16PS and VCVTNEPS2BF16 (Zen 4, Sapphire Rapids, Cooper Lake)
# Rows whose candidates exceed this run the fp32 head instead: a screen that lets through more than a few
# tokens has found a near-tie it cannot settle cheaply (64 exact logits cost ~1/500 of a 32k-vocab head)
MAX_CANDIDATES = 64
PANELS_PER_ITEM = 16  # items of the shared product (pool.h): ~32 for a 32k vocabulary
# Steps with more rows than the limit run the fp32 head. The limit depends on the core: VDPBF16PS does 32
# multiply-adds to VFMADD231PS's 16, and where it retires about as often (Zen 4: rate ratio 1.0) the screen
# wins at every row count measured (1.5-1.9x at 8 to 64 rows); where it retires at a quarter of the rate
# (Emerald Rapids: 1.3 vs 5.2 G instructions/s) it wins only while the head is bound by its bytes, up to 6
# rows (one register block), and loses from 8 (0.85-0.98x). docs/benchmarks/engine.md, "Eleventh pass" and
# "Twelfth pass". The ratio is probed once per process (screen.cpp, a few ms, registers only).
SLOW_DOT_MAX_ROWS = 6
FAST_DOT_MAX_ROWS = 64
FAST_DOT_RATIO = 0.75  # dot/FMA instruction rate from which the fast limit applies (1.5x the multiply-adds)


def unavailable_reason() -> str | None:
    """Why the screen cannot run here, or None."""
    if not native.enabled("screen"):
        return f"{native.ENV_SWITCH} turns it off"
    reason = native.unrunnable_reason()
    if reason is not None:
        return reason
    if CPU_FLAG not in native.cpu_flags():
        return f"the CPU lacks {CPU_FLAG}"
    if step.module() is None:
        return "the native step module did not load"
    return None


@functools.cache
def dot_rate_ratio() -> float | None:
    """VDPBF16PS over VFMADD231PS instruction rate on this core (screen.cpp's probe), or None where the
    screen cannot run."""
    mod = step.module()
    if mod is None or CPU_FLAG not in native.cpu_flags():
        return None
    return float(mod.bf16_dot_rate_ratio())


def max_rows() -> int:
    """Rows up to which a step takes the screen: 64 where this core's bf16 dot product is fast (see
    FAST_DOT_RATIO), 6 where it is not."""
    ratio = dot_rate_ratio()
    return FAST_DOT_MAX_ROWS if ratio is not None and ratio >= FAST_DOT_RATIO else SLOW_DOT_MAX_ROWS


@dataclass(frozen=True, eq=False)
class ScreenedHead:
    """An LM head's fp32 panels (linear.cpp's, shared with the head) with their bf16 screen."""

    wp: torch.Tensor  # [NB, K, 64] fp32: the head's own panels
    wb: torch.Tensor  # [NB, ceil(K/2), 64, 2] bf16 bits (int16)
    coef: torch.Tensor  # [2, n] fp32: each row's error coefficients (screen.cpp)
    n: int

    @classmethod
    def build(cls, wp: torch.Tensor, n: int) -> ScreenedHead:
        mod = step.module()
        assert mod is not None, "native step module not available"
        wb, coef = mod.screen_pack(native_linear.unpack(wp, n))
        return cls(wp, wb, coef, n)

    def argmax(self, h: torch.Tensor, max_candidates: int = MAX_CANDIDATES) -> torch.Tensor:
        """int64 ``[M]``: ``argmax(h @ W.T)`` per row of ``h [M, K]`` fp32, as linear.cpp's logits give it; -1
        where undecided."""
        mod = step.module()
        assert mod is not None
        out: torch.Tensor = mod.screen_argmax(h, self.wb, self.coef, self.wp, self.n, max_candidates,
                                              PANELS_PER_ITEM)
        return out

    @property
    def nbytes(self) -> int:
        """Memory the screen adds to the head's."""
        return self.wb.numel() * self.wb.element_size() + self.coef.numel() * self.coef.element_size()
