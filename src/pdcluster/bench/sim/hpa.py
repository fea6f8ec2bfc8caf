"""The Horizontal Pod Autoscaler's step for one pool, as `simulate`'s HPA-style policies run it (`independent`
on utilisation, `keda-tokens` on the metrics KEDA feeds it): `desired = ceil(metric / target)` for a metric
summed over the pool (`AverageValue`), nothing within the tolerance, growth at once up to `up_pods` a
period, shrinking to the highest recommendation of the stabilization window, `down_pods` a period."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Behavior:
    """`spec.behavior` and the controller's tolerance (period 0: as often as the loop runs)."""

    tolerance: float = 0.1  # the HPA's default
    stabilization_s: float = 300.0  # scale-down: to the highest recommendation of this window
    up_pods: int = 4
    up_period_s: float = 0.0
    down_pods: int = 1
    down_period_s: float = 0.0


@dataclass
class HpaPool:
    """One pool's HPA: its recommendations (the scale-down window) and its last changes (the rate limits)."""

    recs: list[tuple[float, int]] = field(default_factory=list)
    ups: list[float] = field(default_factory=list)
    downs: list[float] = field(default_factory=list)

    def shifted(self, dt: float) -> HpaPool:
        """The same history `dt` seconds earlier (a primed run's second pass starts at 0)."""
        return HpaPool([(t - dt, n) for t, n in self.recs], [t - dt for t in self.ups], [t - dt for t in self.downs])

    def step(self, b: Behavior, now: float, current: int, metric: float, target: float, lo: int,
             hi: int | None) -> int:
        """The next size of a pool of `current` whose summed metric reads `metric` against `target` a replica."""
        ratio = metric / (target * current) if current else math.inf
        rec = current if abs(ratio - 1.0) <= b.tolerance else math.ceil(metric / target - 1e-9)
        rec = max(lo, rec if hi is None else min(hi, rec))
        self.recs = [(t, n) for t, n in self.recs if now - t < b.stabilization_s] + [(now, rec)]
        self.ups = [t for t in self.ups if now - t < b.up_period_s]
        self.downs = [t for t in self.downs if now - t < b.down_period_s]
        if rec > current:
            if self.ups:
                return current
            if b.up_period_s:
                self.ups.append(now)
            return min(rec, current + b.up_pods)
        stable = max(n for _, n in self.recs)
        if stable < current and not self.downs:
            if b.down_period_s:
                self.downs.append(now)
            return max(stable, current - b.down_pods)
        return current
