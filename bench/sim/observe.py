"""What the autoscaler would read from Prometheus, computed from the simulation's own counters.

The same quantities as `pdcluster.operator.promsource.PrometheusSource.observe`, over the same window:
λ = rate of requests admitted by the router; I, O = prompt / generated token rates divided by λ;
per-instance throughput = the pool's token rate divided by the instances reporting metrics; saturated =
the pool's waiting queue stayed non-empty at every sample of the window (`min_over_time(...[w:step])`,
step = min(15 s, window/10)). Counters are sampled at each autoscaler tick, so a window is exact when it
is a multiple of the interval (the defaults: 120 s and 30 s).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from pdcluster.operator.autoscaler import Observation


@dataclass
class Counters:
    admitted: int = 0  # pdcluster_requests_total{role="router"}
    prompt_tokens: int = 0  # pdcluster_prompt_tokens_total{role="router"}
    prefill_tokens: int = 0  # pdcluster_prompt_tokens_total{role="prefill"} (at prefill start)
    generated: float = 0.0  # pdcluster_generation_tokens_total (fluid: fractional between events)

    def snapshot(self) -> tuple[int, int, int, float]:
        return (self.admitted, self.prompt_tokens, self.prefill_tokens, self.generated)


@dataclass(frozen=True)
class PolicyInput:
    now: float
    observation: Observation | None
    prefill_current: int
    prefill_ready: int
    decode_current: int
    decode_ready: int
    prefill_utilisation: float | None  # busy share of the reporting instances' capacity over the window
    decode_utilisation: float | None


@dataclass
class Sampler:
    window_s: float
    times: list[float] = field(default_factory=list)
    snaps: list[tuple[int, int, int, float]] = field(default_factory=list)
    qtimes: list[float] = field(default_factory=list)
    pq: list[int] = field(default_factory=list)
    dq: list[int] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return float(max(1, min(15, int(self.window_s) // 10)))

    def record_counters(self, now: float, c: Counters) -> None:
        self.times.append(now)
        self.snaps.append(c.snapshot())

    def record_queues(self, now: float, prefill_waiting: int, decode_waiting: int) -> None:
        self.qtimes.append(now)
        self.pq.append(prefill_waiting)
        self.dq.append(decode_waiting)

    def _delta(self, now: float) -> tuple[float, tuple[float, ...]] | None:
        """(span seconds, counter increases) over the window ending at the latest snapshot."""
        if len(self.times) < 2:
            return None
        j = bisect.bisect_left(self.times, now - self.window_s - 1e-9)
        j = min(j, len(self.times) - 2)
        span = self.times[-1] - self.times[j]
        if span <= 0:
            return None
        return span, tuple(b - a for a, b in zip(self.snaps[j], self.snaps[-1], strict=True))

    def _saturated(self, now: float, queue: list[int]) -> bool:
        j = bisect.bisect_left(self.qtimes, now - self.window_s - 1e-9)
        vals = queue[j:]
        return bool(vals) and min(vals) > 0

    def observation(self, now: float, prefill_reporting: int, decode_reporting: int) -> Observation | None:
        d = self._delta(now)
        if d is None:
            return None  # no series yet: the autoscaler holds (MetricsUnavailable)
        span, (adm, prompt, prefilled, gen) = d
        rate = adm / span
        return Observation(
            request_rate=rate,
            mean_input_tokens=prompt / adm if adm else None,
            mean_output_tokens=gen / adm if adm else None,
            prefill_tokens_per_instance=prefilled / span / prefill_reporting if prefill_reporting else None,
            decode_tokens_per_instance=gen / span / decode_reporting if decode_reporting else None,
            prefill_saturated=self._saturated(now, self.pq),
            decode_saturated=self._saturated(now, self.dq),
        )

    def utilisation(self, now: float, role: str, reporting: int, capacity: float) -> float | None:
        """Pool throughput over the window as a share of its reporting instances' capacity (HPA's view)."""
        d = self._delta(now)
        if d is None or not reporting:
            return None
        span, (_, _, prefilled, gen) = d
        tokens = prefilled if role == "prefill" else gen
        return min(1.0, tokens / span / (reporting * capacity))
