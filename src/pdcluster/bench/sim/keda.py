"""`keda-tokens`: llm-d's token-aware KEDA autoscaling for a P/D-disaggregated pool pair, as its guide ships it
(llm-d `guides/workload-autoscaling/keda-epp-token-aware`, pd-disaggregation): a peer to compare against, not
ours. Two ScaledObjects, each pool blind to the other:

- prefill: the prompt tokens in flight at the prefill pods (the EPP's `llm_d_epp_inflight_tokens`: sent and
  not yet prefilled) divided by the calibrated per-replica prefill throughput V_P — seconds of backlog — with
  an `AverageValue` target of `TTFT_SLO - ISL/V_P` seconds per replica (the guide's rule for its threshold;
  ISL: the trace's mean prompt, which a user calibrates once);
- decode: the decode pods' KV-cache usage summed (pods' worth of full cache) at 0.8 per replica. The
  simulator has batch slots, not KV blocks (`cluster.py`): a decode instance's share of its batch stands
  for its cache usage;
- each as the HPA KEDA creates: polled every 15 s, `desired = ceil(metric / target)` outside a 10 % tolerance,
  scale-up at most one pod per 180 s with no stabilization, scale-down at most one pod per 300 s to the
  highest recommendation of the last 300 s. No role flips, no aggregation of its own (the router's
  `--load-aggregation` is the cluster's, as for every policy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdcluster.bench.sim.observe import PolicyInput
from pdcluster.operator.planner import Bounds

POLL_S = 15.0  # pollingInterval
TOLERANCE = 0.1  # the HPA's default
UP_PERIOD_S, DOWN_PERIOD_S = 180.0, 300.0  # behavior: one pod per period
DOWN_STABILIZATION_S = 300.0
DECODE_TARGET = 0.8  # pods' worth of full KV cache per replica
MIN_PREFILL_TARGET_S = 0.5  # a floor for TTFT - ISL/V_P where prompts alone nearly fill the TTFT budget


@dataclass
class _Pool:
    """One HPA: its recommendations (for the scale-down window) and its last changes (for the rate limits)."""

    recs: list[tuple[float, int]] = field(default_factory=list)
    ups: list[float] = field(default_factory=list)
    downs: list[float] = field(default_factory=list)

    def shifted(self, dt: float) -> _Pool:
        return _Pool([(t - dt, n) for t, n in self.recs], [t - dt for t in self.ups], [t - dt for t in self.downs])


def hpa_step(pool: _Pool, now: float, current: int, metric: float, target: float, lo: int, hi: int | None,
             up_period_s: float = UP_PERIOD_S) -> int:
    """The HPA's next size for one pool (AverageValue: the metric is the pool's total)."""
    ratio = metric / (target * current) if current else math.inf
    rec = current if abs(ratio - 1.0) <= TOLERANCE else max(1, math.ceil(metric / target - 1e-9))
    rec = max(lo, rec if hi is None else min(hi, rec))
    pool.recs = [(t, n) for t, n in pool.recs if now - t < DOWN_STABILIZATION_S] + [(now, rec)]
    if rec > current:
        if any(now - t < up_period_s for t in pool.ups):
            return current
        pool.ups.append(now)
        return current + 1
    stable = max(n for _, n in pool.recs)
    if stable < current and not any(now - t < DOWN_PERIOD_S for t in pool.downs):
        pool.downs.append(now)
        return current - 1
    return current


@dataclass
class KedaTokens:
    """llm-d's token-aware KEDA ScaledObjects, one per role (see the module docstring)."""

    bounds: Bounds
    prefill_tps: float  # V_P, the calibrated prefill throughput per replica
    prefill_target_s: float  # seconds of prefill backlog per replica
    name: str = "keda-tokens"
    start: tuple[int, int] | None = None
    pools: dict[str, _Pool] = field(default_factory=lambda: {"prefill": _Pool(), "decode": _Pool()})
    interval_s: float = POLL_S  # the simulated loop ticks at the polling interval
    up_period_s: float = UP_PERIOD_S  # the guide's, for weights that load in minutes

    @staticmethod
    def target_s(ttft_s: float, mean_input_tokens: float, prefill_tps: float) -> float:
        """The guide's threshold: the TTFT budget less one prompt's own prefill."""
        return max(MIN_PREFILL_TARGET_S, ttft_s - mean_input_tokens / prefill_tps)

    def initial(self) -> tuple[int, int]:
        return self.start or (self.bounds.min_prefill, self.bounds.min_decode)

    def decide(self, inp: PolicyInput) -> tuple[int, int]:
        b = self.bounds
        backlog_s = (inp.prefill_inflight_tokens or 0.0) / self.prefill_tps
        p = hpa_step(self.pools["prefill"], inp.now, inp.prefill_current, backlog_s, self.prefill_target_s,
                     b.min_prefill, b.max_prefill, self.up_period_s)
        d = hpa_step(self.pools["decode"], inp.now, inp.decode_current, inp.decode_occupancy or 0.0, DECODE_TARGET,
                     b.min_decode, b.max_decode, self.up_period_s)
        return p, d

    def carried(self, duration_s: float, sizes: tuple[int, int]) -> KedaTokens:
        """After a first pass over the trace (`policies.carry_over`): its history moved back, its sizes."""
        return KedaTokens(self.bounds, self.prefill_tps, self.prefill_target_s, self.name, sizes,
                          {r: p.shifted(duration_s) for r, p in self.pools.items()}, self.interval_s, self.up_period_s)
