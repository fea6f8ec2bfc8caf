"""Pure: the declared prefill:decode bounds (`spec.autoscaling.ratio: {min, max}`, P/D) on a decision.

Every decision's sizes pass through `enforce`: when P/D falls below `min` the prefill pool grows to
`ceil(min·D)`; above `max` the decode pool grows to `ceil(P/max)`. Growing the short pool never takes
capacity from the other, so a ratio bound cannot cause an SLO miss by itself. Only where the short pool
cannot grow (its maxReplicas, or maxTotalReplicas) does the other pool shrink to fit the bound, never
below its minReplicas. When even that cannot meet the bound (the replica bounds contradict it) the sizes
stay within the replica bounds and the result says so (`unsatisfiable`), surfaced as ScalingLimited.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pdcluster.operator.planner import Bounds

if TYPE_CHECKING:
    from pdcluster.operator.autoscaler import Policy, PoolDecision, PoolState

EPS = 1e-9
RATIO_MIN = "ratio-min"  # limited_by entries
RATIO_MAX = "ratio-max"
RATIO_UNSATISFIABLE = "ratio-unsatisfiable"
RATIO_BOUND = "RatioBound"  # the reason of a decision (and of each pool) the bound moved


@dataclass(frozen=True)
class RatioBounds:
    min: float | None = None  # P/D at least
    max: float | None = None  # P/D at most

    def __post_init__(self) -> None:
        for name in ("min", "max"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"ratio {name} must be a finite number > 0 (got {v})")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"ratio min {self.min:g} must be <= max {self.max:g}")

    @property
    def declared(self) -> bool:
        return self.min is not None or self.max is not None

    def holds(self, p: int, d: int) -> bool:
        if d <= 0:
            return p <= 0 or self.max is None  # P/D infinite: only an unbounded max allows it
        r = p / d
        return (self.min is None or r >= self.min - EPS) and (self.max is None or r <= self.max + EPS)


@dataclass(frozen=True)
class Enforced:
    prefill: int
    decode: int
    limited_by: tuple[str, ...] = ()  # RATIO_MIN / RATIO_MAX when the bound moved a pool; or RATIO_UNSATISFIABLE

    @property
    def moved(self) -> bool:
        return bool(self.limited_by) and RATIO_UNSATISFIABLE not in self.limited_by


def _within_budget(p: int, d: int, ratio: RatioBounds, bounds: Bounds, asked: float) -> tuple[int, int] | None:
    """The largest (p', d') <= (p, d) within the budget, the replica bounds and the ratio (most total,
    then the P/D closest to the `asked` one); None when there is none."""

    def distance(pp: int, dd: int) -> float:
        r = pp / dd if dd else math.inf
        return abs(math.log(r / asked)) if 0 < r < math.inf and 0 < asked < math.inf else math.inf

    best: tuple[int, int] | None = None
    total = bounds.max_total if bounds.max_total is not None else p + d
    for pp in range(min(p, total), bounds.min_prefill - 1, -1):
        dd = min(d, total - pp)
        if dd < bounds.min_decode:
            continue
        if ratio.max is not None and dd > 0 and pp / dd > ratio.max + EPS:
            continue  # too few decode for this prefill: a smaller pp may fit
        if ratio.min is not None:
            dd = min(dd, math.floor(pp / ratio.min + EPS))
        if dd < bounds.min_decode or not ratio.holds(pp, dd):
            continue
        if best is None or pp + dd > sum(best) or (pp + dd == sum(best) and distance(pp, dd) < distance(*best)):
            best = (pp, dd)
    return best


def enforce(p: int, d: int, ratio: RatioBounds, bounds: Bounds) -> Enforced:
    """(P, D) within the declared ratio, see the module docstring. `p`, `d` are within `bounds` already."""
    if not ratio.declared or ratio.holds(p, d):
        return Enforced(p, d)
    why = RATIO_MIN if ratio.min is not None and d > 0 and p / d < ratio.min - EPS else RATIO_MAX
    # 1. grow the short pool
    if why == RATIO_MIN:
        p2, d2 = bounds.clamp("prefill", math.ceil(ratio.min * d - EPS)), d  # type: ignore[operator]
    else:
        d2, p2 = bounds.clamp("decode", math.ceil(p / ratio.max - EPS)), p  # type: ignore[operator]
    fits_total = bounds.max_total is None or p2 + d2 <= bounds.max_total
    if ratio.holds(p2, d2) and fits_total:
        return Enforced(p2, d2, (why,))
    # 2. no room to grow it far enough: the largest sizes within every bound at or below the grown ones
    got = _within_budget(p2, d2, ratio, bounds, p / d if d else math.inf)
    if got is not None:
        return Enforced(got[0], got[1], (why,))
    return Enforced(p, d, (RATIO_UNSATISFIABLE,))


def keep(policy: Policy, out: dict[str, PoolDecision], pool_states: dict[str, PoolState],
         now: float) -> tuple[bool, list[str]]:
    """`enforce` on a decision's pools, in place: (moved, limited_by). A pool the bound moves counts as
    changed now (its next windows are warm-up)."""
    e = enforce(out["prefill"].desired, out["decode"].desired, policy.ratio, policy.bounds)
    if not e.moved:
        return False, list(e.limited_by)
    for r, n in (("prefill", e.prefill), ("decode", e.decode)):
        if n != out[r].desired:
            out[r] = replace(out[r], desired=n, reason=RATIO_BOUND)
            if n != out[r].current:
                pool_states[r] = replace(pool_states[r], last_change=now, below_since=None)
    return True, list(e.limited_by)
