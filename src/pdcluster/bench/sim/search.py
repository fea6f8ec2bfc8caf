"""`static-best`: the cheapest fixed (P, D) that meets the SLOs over the whole trace, in hindsight.

Attainment grows with either pool (more instances never slow a request down in this model), so: the
fewest prefill instances that meet the target with decode generous, the fewest decode instances with
prefill generous, then the cheapest split at or above both, found by growing the total one at a time.
When no size can meet the target (requests whose prompt alone takes longer than the TTFT SLO), the
target becomes what a generous static cluster reaches, so the bar is still the cheapest best.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from pdcluster.bench.trace import Trace


def generous_sizes(trace: Trace, prefill_tps: float, decode_tps: float, decode_batch: int) -> tuple[int, int]:
    """Sizes comfortably above the busiest minute's need (an upper end for the search)."""
    reqs, lo = trace.requests, 0
    p_tok = d_tok = 0.0
    best_p = best_d = 0.0
    for r in reqs:
        p_tok += r.input_tokens
        d_tok += r.output_tokens
        while reqs[lo].t <= r.t - 60.0:
            p_tok -= reqs[lo].input_tokens
            d_tok -= reqs[lo].output_tokens
            lo += 1
        best_p, best_d = max(best_p, p_tok), max(best_d, d_tok)
    p = math.ceil(best_p / 60.0 / prefill_tps) * 2 + 2
    d = math.ceil(best_d / 60.0 / decode_tps) * 2 + 2
    return p, d


def _lowest(ok: Callable[[int], bool], hi: int) -> int:
    lo = 1
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def static_best(attainment: Callable[[int, int], float], target: float, p_hi: int, d_hi: int,
                max_extra: int = 6) -> tuple[int, int, float]:
    """(P, D, target used). `attainment(P, D)` runs the static cluster and returns its SLO attainment."""
    ceiling = attainment(p_hi, d_hi)
    goal = min(target, ceiling - 1e-9)
    p0 = _lowest(lambda p: attainment(p, d_hi) >= goal, p_hi)
    d0 = _lowest(lambda d: attainment(p_hi, d) >= goal, d_hi)
    for total in range(p0 + d0, p0 + d0 + max_extra + 1):
        for p in range(p0, total - d0 + 1):
            if attainment(p, total - p) >= goal:
                return p, total - p, goal
    return p_hi, d_hi, goal
