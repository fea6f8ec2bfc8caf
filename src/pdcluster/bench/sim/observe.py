"""What the autoscaler would read from Prometheus, computed from the simulation's own counters.

The same quantities as `pdcluster.operator.promsource.PrometheusSource.observe`, over the same window:
λ = rate of requests admitted by the router; I, O = prompt / generated token rates divided by λ;
per-instance throughput = the pool's token rate divided by the instances reporting metrics; saturated =
the pool's waiting queue stayed non-empty at every sample of the window (`min_over_time(...[w:step])`,
step = min(15 s, window/10)). Counters are sampled at each autoscaler tick, so a window is exact when it
is a multiple of the interval (the defaults: 120 s and 30 s).

The optional observations the same way: the prefix-cache hit rate = hit tokens / prompt tokens of the
prefill pool over the window; the peak λ = the highest `burst_s` request rate at sub-steps of `burst_s/2`
within the window (the `max_over_time(rate(...[b])[w:b/2])` subquery); TTFT/TPOT at a percentile =
`histogram_quantile` over the router's histogram buckets (`worker/api/metrics.py`) filled by the requests
observed within the window, interpolated inside a bucket as Prometheus does; the load-aggregated rate = the
prompts the router's load rule placed on decode instances per second of the window; the prompt-length SCV =
`histogram_scv` of the router's `pdcluster_request_prompt_tokens` buckets filled by the requests that finished
within the last `SCV_WINDOW_SECONDS` (the prefill tail need, `operator/autoscaler_tail.py`).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from pdcluster.operator.autoscaler import Observation
from pdcluster.operator.autoscaler_fast import Gauges
from pdcluster.operator.autoscaler_tail import SCV_WINDOW_SECONDS, histogram_scv
from pdcluster.worker.api.metrics import LENGTH_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS

Snapshot = tuple[int, int, int, float, int, int, int, int]  # Counters' fields, in order


@dataclass
class Counters:
    admitted: int = 0  # pdcluster_requests_total{role="router"}
    prompt_tokens: int = 0  # pdcluster_prompt_tokens_total{role="router"}
    prefill_tokens: int = 0  # pdcluster_prompt_tokens_total{role="prefill"} (at prefill start)
    generated: float = 0.0  # pdcluster_generation_tokens_total (fluid: fractional between events)
    prefix_hit_tokens: int = 0  # pdcluster_prefix_cache_hit_tokens_total{role="prefill"}
    finished: int = 0  # pdcluster_request_generation_tokens_count{role="router"}: requests that ended
    finished_tokens: int = 0  # ..._sum: their generated tokens
    load_aggregated: int = 0  # pdcluster_router_placements_total{placement="aggregated",reason="prefill_backlog"}

    def snapshot(self) -> Snapshot:
        return (self.admitted, self.prompt_tokens, self.prefill_tokens, self.generated, self.prefix_hit_tokens,
                self.finished, self.finished_tokens, self.load_aggregated)


def bucket_counts(buckets: tuple[float, ...], values: Iterable[float]) -> list[int]:
    """`values` counted into a Prometheus histogram's buckets of upper bounds `buckets` (the last: +Inf)."""
    counts = [0] * (len(buckets) + 1)
    for v in values:
        counts[bisect.bisect_left(buckets, v)] += 1
    return counts


def histogram_quantile(q: float, buckets: tuple[float, ...], values: list[float]) -> float | None:
    """Prometheus's histogram_quantile over `values` bucketed by upper bounds `buckets` (+Inf implied)."""
    if not values:
        return None
    counts = bucket_counts(buckets, values)
    rank, cum = q * len(values), 0
    for i, c in enumerate(counts):
        if cum + c >= rank and c:
            if i == len(buckets):
                return buckets[-1]  # the +Inf bucket: Prometheus answers the highest finite bound
            lo = buckets[i - 1] if i else 0.0
            return lo + (buckets[i] - lo) * (rank - cum) / c
        cum += c
    return buckets[-1]


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
    short_observation: Observation | None = None  # the flip window's (`Sampler.short`), when the policy has one
    # gauges a peer's scaler reads (keda.py): prompt tokens sent to the prefill pool and not yet prefilled, and
    # the decode instances' batch occupancy summed (pods' worth of full batch: the simulator's KV usage)
    prefill_inflight_tokens: float | None = None
    decode_occupancy: float | None = None


@dataclass
class Sampler:
    window_s: float
    burst_s: float = 0.0  # 0 = no peak λ
    percentile: float | None = None  # None = no latency quantiles
    times: list[float] = field(default_factory=list)
    snaps: list[Snapshot] = field(default_factory=list)
    admit_times: list[float] = field(default_factory=list)
    ttft: list[tuple[float, float]] = field(default_factory=list)  # (when observed, seconds), in time order
    tpot: list[tuple[float, float]] = field(default_factory=list)
    prompts: list[tuple[float, int]] = field(default_factory=list)  # (when finished, prompt tokens), in time order
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

    def peak_rate(self, now: float) -> float | None:
        if not self.burst_s or self.burst_s >= self.window_s:
            return None
        sub, best, t = self.burst_s / 2, 0.0, now
        while t > now - self.window_s + 1e-9:
            n = bisect.bisect_right(self.admit_times, t) - bisect.bisect_right(self.admit_times, t - self.burst_s)
            best = max(best, n / self.burst_s)
            t -= sub
        return best

    def quantile(self, now: float, samples: list[tuple[float, float]], buckets: tuple[float, ...]) -> float | None:
        if self.percentile is None:
            return None
        j = bisect.bisect_right(samples, (now - self.window_s, math.inf))  # (now - w, now], as PromQL
        return histogram_quantile(self.percentile, buckets, [v for _, v in samples[j:]])

    def prompt_scv(self, now: float) -> float | None:
        """The prompt-length SCV of the requests finished in the last `SCV_WINDOW_SECONDS` (at least the window),
        from the router's histogram buckets."""
        j = bisect.bisect_right(self.prompts, (now - max(self.window_s, SCV_WINDOW_SECONDS), math.inf))
        cum = list(itertools.accumulate(bucket_counts(LENGTH_BUCKETS, (n for _, n in self.prompts[j:]))))
        return histogram_scv([*zip(LENGTH_BUCKETS, cum, strict=False), (math.inf, cum[-1])])

    def _queue_mean(self, now: float, queue: list[int]) -> float | None:
        j = bisect.bisect_left(self.qtimes, now - self.window_s - 1e-9)
        vals = queue[j:]
        return sum(vals) / len(vals) if vals else None

    def _saturated(self, now: float, queue: list[int]) -> bool:
        j = bisect.bisect_left(self.qtimes, now - self.window_s - 1e-9)
        vals = queue[j:]
        return bool(vals) and min(vals) > 0

    def observation(self, now: float, prefill_reporting: int, decode_reporting: int) -> Observation | None:
        d = self._delta(now)
        if d is None:
            return None  # no series yet: the autoscaler holds (MetricsUnavailable)
        span, (adm, prompt, prefilled, gen, hits, fin, fin_tokens, agg) = d
        rate = adm / span
        return Observation(
            request_rate=rate,
            mean_input_tokens=prompt / adm if adm else None,
            mean_output_tokens=gen / adm if adm else None,
            prefill_tokens_per_instance=prefilled / span / prefill_reporting if prefill_reporting else None,
            decode_tokens_per_instance=gen / span / decode_reporting if decode_reporting else None,
            prefill_saturated=self._saturated(now, self.pq),
            decode_saturated=self._saturated(now, self.dq),
            prefix_hit_rate=hits / prefilled if prefilled else None,
            peak_request_rate=self.peak_rate(now),
            ttft_seconds=self.quantile(now, self.ttft, TTFT_BUCKETS),
            tpot_seconds=self.quantile(now, self.tpot, TPOT_BUCKETS),
            prefill_queue_mean=self._queue_mean(now, self.pq),
            decode_queue_mean=self._queue_mean(now, self.dq),
            prefill_queue_now=float(self.pq[-1]) if self.pq else None,
            decode_queue_now=float(self.dq[-1]) if self.dq else None,
            finished_output_tokens=fin_tokens / fin if fin else None,
            load_aggregated_rate=agg / span,
            prompt_length_scv=self.prompt_scv(now),
        )

    def short(self, now: float, window_s: float) -> Observation | None:
        """λ, I, O and the prefix-hit rate over the last `window_s` (the flip window: the operator's `observe`
        with `spec.autoscaling.flipWindowSeconds`); exact when counters were recorded `window_s` ago."""
        if len(self.times) < 2:
            return None
        j = min(bisect.bisect_left(self.times, now - window_s - 1e-9), len(self.times) - 2)
        span = self.times[-1] - self.times[j]
        if span <= 0:
            return None
        adm, prompt, prefilled, gen, hits, fin, fin_tokens, _ = (
            b - a for a, b in zip(self.snaps[j], self.snaps[-1], strict=True))
        return Observation(request_rate=adm / span, mean_input_tokens=prompt / adm if adm else None,
                           mean_output_tokens=gen / adm if adm else None,
                           finished_output_tokens=fin_tokens / fin if fin else None,
                           prefix_hit_rate=hits / prefilled if prefilled else None,
                           prefill_queue_now=float(self.pq[-1]) if self.pq else None,
                           decode_queue_now=float(self.dq[-1]) if self.dq else None)

    def gauges(self) -> dict[str, Gauges]:
        """Each pool's queue gauge at the last two samples (the fast path's view: a scrape late at most)."""
        if len(self.qtimes) < 2:
            return {}
        dt = self.qtimes[-1] - self.qtimes[-2]
        return {"prefill": Gauges(float(self.pq[-1]), float(self.pq[-2]), dt),
                "decode": Gauges(float(self.dq[-1]), float(self.dq[-2]), dt)}

    def utilisation(self, now: float, role: str, reporting: int, capacity: float) -> float | None:
        """Pool throughput over the window as a share of its reporting instances' capacity (HPA's view)."""
        d = self._delta(now)
        if d is None or not reporting:
            return None
        span, (_, _, prefilled, gen, *_) = d
        tokens = prefilled if role == "prefill" else gen
        return min(1.0, tokens / span / (reporting * capacity))
