"""The autoscaler's small pure rules, kept apart from `decide` so each one is testable alone.

- `learn_capacity`: per-instance capacity from one window's throughput (EWMA while saturated).
- `warming_up`: whether a window's throughput sample is a cold-start sample (skipped for learning).
- `NeedWindow`: the sliding window of recent needs behind scale-down stabilization (bounded size).
- `slo_breaches`: which pool the observed latency percentiles say is too small.
- `prefill_tokens`: the formula's I discounted by the observed prefix-cache hit rate.
- `burst_spread`: how much of a burst's peak rate the pool must serve within the TTFT target.
- `effective_headroom`: the headroom the load's observed variability calls for, the spec's as the ceiling.
- `counting_noise`: how far a window's peak rate lies above a steady mean by chance (Poisson counts).
- `guard_applies`: whether a broken percentile is one that more replicas would cure (a queue that waits).
- `queue_in_front`: the decode queue a breach is judged by (the mean, or the queue now when it is building).
- `queue_wait`: the wait a pool's queue adds (Little's law).
- `backlog_clears`: whether the ready pool works off its queue within a window (then the guard waits).
- `backlog_need`: the instances a saturated pool needs, read from its queue gauge between two scrapes (fast path).
- `gauges_predate`: whether two scrapes of a queue gauge may predate the pool's last change being ready.
- `capacity_cut`: the SLO correction after a guard step (none for a backlog left from before a change).
- `guard_step`: how many replicas the SLO guard adds (in proportion to the part of the breach a queue explains).
- `pool_need`: a pool's unrounded need, and the part of it a remembered burst holds up.
- `join_cost`: t_join from the decode workers' admission time and step time (the step is O/C_d's).
- `join_seconds`: the decode pool's per-request admission cost (t_join) the formula adds to O/C_d.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

EWMA_ALPHA = 0.3
# The window of needs kept in status.autoscaler is bounded: samples share fixed time buckets of
# keep/(MAX_NEED_SAMPLES-1) seconds, each bucket keeping its largest need at its latest time (a peak then
# lives at most one bucket longer than the window: scale-down only ever gets more conservative).
MAX_NEED_SAMPLES = 32
# On an SLO breach the capacity the formula uses is cut by this factor (not below MIN_CAPACITY_SCALE of
# the configured/learned value); while the SLO is met it recovers by CAPACITY_RECOVERY per decision, so a
# correction fades over tens of minutes, not at the next quiet tick, and a breach that more replicas did
# not cure (one huge prompt is slow on any pool size) does not keep the pool large for good.
SLO_CAPACITY_CUT = 0.85
MIN_CAPACITY_SCALE = 0.4
CAPACITY_RECOVERY = 0.01
SLO_COMFORT = 1.0  # "met": a correction fades whenever the percentile is within the target
GUARD_MIN_QUEUE = 0.5  # requests waiting on average over the window before the SLO guard grows a pool
# ... and the wait that queue adds (Little's law: mean queue / λ) must be at least this share of the target:
# a p99 broken by a few huge prompts (Mooncake: 126k tokens take 12.6 s on any pool size) while the queue
# adds a second is not cured by a replica more, and each false guard step also cuts the capacity.
GUARD_MIN_WAIT_SHARE = 0.2
MAX_PREFIX_HIT = 0.95  # never trust a hit rate that would make prefill free
# The highest of a window's burst-window rates sits about this many standard deviations of a Poisson count
# above a steady mean by chance (the expected maximum of a dozen normal samples is 1.6-2.2 σ).
NOISE_SIGMAS = 2.0


def learn_capacity(previous: float | None, observed: float | None, saturated: bool,
                   alpha: float = EWMA_ALPHA) -> float | None:
    """Update a learned per-instance capacity from one window's observed throughput."""
    if observed is None or not math.isfinite(observed) or observed <= 0:
        return previous
    if saturated:
        return observed if previous is None else previous + alpha * (observed - previous)
    if previous is not None and observed > previous:
        # An unsaturated pool served more than we thought it could: capacity is at least that.
        return observed
    return previous


def warming_up(now: float, last_change: float | None, since: float | None, current: int, ready: int,
               window_seconds: float | None) -> bool:
    """A throughput sample taken while instances were starting is not evidence of capacity.

    A fresh pod serves slowly at first (weights paging in, kernels compiling, CUDA graphs captured) and a
    pod that is not ready yet reports nothing while the queue grows: either way a saturated window
    measures the warm-up, not the steady state, and learning from it over-scales the pool (Dynamo's
    planner, #12430). So a window that began before the pool's last change (or its creation) finished,
    or any window while the pool is still rolling out, teaches nothing.
    """
    if ready < current:
        return True
    ref = last_change if last_change is not None else since
    return ref is not None and window_seconds is not None and now - ref < window_seconds


def prefill_tokens(mean_input: float, hit_rate: float | None) -> float:
    """Prompt tokens per request that prefill actually computes: the uncached share of I."""
    if hit_rate is None or not math.isfinite(hit_rate) or hit_rate <= 0:
        return mean_input
    return mean_input * (1.0 - min(hit_rate, MAX_PREFIX_HIT))


def burst_spread(role: str, burst_window: float | None, ttft_target: float | None) -> float:
    """Share of a burst's rate a pool must serve: prompts arriving over b seconds may get their first
    token over b + the TTFT target, so a pool needs b/(b+TTFT) of the peak rate (without a TTFT target or
    a known burst window, all of it). Both pools: a request waiting for a decode slot waits for its first
    token (a full decode batch delays TTFT, not TPOT: the batch bound caps the step time), and the
    prefill pool, sized to this share, hands the burst on at that pace anyway."""
    if not burst_window or not ttft_target:
        return 1.0
    return burst_window / (burst_window + ttft_target)


def counting_noise(rate: float, burst_window: float | None) -> float:
    """How far the highest `burst_window`-second rate of a window lies above a steady mean `rate` by chance
    alone: arrivals at a steady rate λ are a Poisson count, λ·b ± √(λ·b) over b seconds, and the highest of
    a window's dozen burst windows is about NOISE_SIGMAS standard deviations above the mean
    (NOISE_SIGMAS·√(λ/b) in rate). 0 when the burst window is unknown."""
    if not burst_window or burst_window <= 0 or rate <= 0 or not math.isfinite(rate):
        return 0.0
    return NOISE_SIGMAS * math.sqrt(rate / burst_window)


def effective_headroom(ceiling: float, rate: float | None, peak: float | None, bursty_ratio: float,
                       burst_window: float | None = None) -> float:
    """The headroom over the mean rate that the window's variability calls for, at most `ceiling` (the
    spec's headroom). The window's peak burst rate measures how far the rate strays from its mean: at
    a peak of `bursty_ratio` times the mean or more the whole ceiling applies; a peak close to the mean
    (smooth load: slow trends) needs little, since the burst rule and the SLO guard catch what the mean
    misses. The share of the ceiling runs from 0 at the counting noise of a steady rate above the mean
    (`counting_noise`, with the burst window known) to 1 at `bursty_ratio` times the mean: a steady 4 req/s shows 10 s peaks of 5-6 req/s by chance, which read as
    a 1.2-1.4× headroom kept a fourth prefill instance for 3 instances' load (a 3:2 pool served it at
    100 %). Unknown peak: the ceiling (the old, fixed behaviour)."""
    if peak is None or not rate or rate <= 0 or not math.isfinite(peak) or ceiling <= 1.0:
        return ceiling
    floor_ = rate + counting_noise(rate, burst_window)  # a peak up to here is chance
    top = bursty_ratio * rate  # a peak from here on is a burst (as `decide` classifies a window)
    if top <= floor_:  # a rate so low that chance alone reaches a burst's peak: past chance is a burst
        share = 1.0 if peak > floor_ else 0.0
    else:
        share = min(1.0, max(0.0, (peak - floor_) / (top - floor_)))
    return 1.0 + (ceiling - 1.0) * share


def guard_applies(queue_mean: float | None, rate: float | None, target: float | None) -> bool:
    """Whether a broken percentile had a queue in front of the pool that more replicas would shorten:
    requests waiting (GUARD_MIN_QUEUE) and adding a real wait (Little's law: queue/λ) against the target.
    Unknown queue: trust the percentile."""
    if queue_mean is None:
        return True
    if queue_mean < GUARD_MIN_QUEUE:
        return False
    if not rate or rate <= 0 or target is None:
        return True
    return queue_mean / rate >= GUARD_MIN_WAIT_SHARE * target


def queue_in_front(queue_mean: float | None, queue_now: float | None) -> float | None:
    """The decode queue a breach is judged by (`guard_applies`): the window's mean, or the queue now when it is
    larger (a backlog building: the mean covers the minutes before it began). On a turn of the mix to long
    outputs the decode queue was 24 requests at the window's end and 3.8 on average over it, a mean wait of
    0.98 s against the 1 s (0.2 x the target) `guard_applies` asks for: the guard waited a window more while
    the queue grew to 68. Decode only: a decode request holds one batch slot of many, so a queue for decode
    slots means every slot of the pool is taken; a prefill instance serves one prompt at a time, so a couple
    of 100k-token prompts hold instances for 10 s each and queue the prompts behind them on a pool of the right
    size (on the Mooncake trace, judging prefill by its queue now too cost 28 % more instance-hours for
    +0.14 points)."""
    if queue_now is None or not math.isfinite(queue_now) or (queue_mean is not None and queue_now <= queue_mean):
        return queue_mean
    return queue_now


def queue_wait(queue_mean: float | None, rate: float | None) -> float | None:
    """The wait a queue in front of a pool adds (Little's law: mean queue / λ); None when unknown."""
    if queue_mean is None or not math.isfinite(queue_mean) or not rate or rate <= 0:
        return None
    return max(0.0, queue_mean) / rate


def still_queued(queue_now: float | None) -> bool:
    """Whether the queue a breach came with is still there (unknown: assume so). The percentile and the
    mean queue cover the whole window; a queue that has drained by the end of it was a burst the pool has
    absorbed, and replicas ordered for it now start a pod-start after it is over."""
    return queue_now is None or not math.isfinite(queue_now) or queue_now > 0


def backlog_outgrew(current: int, ready: int, wait: float | None, target: float | None) -> bool:
    """Whether a pool whose last change is ready still has a queue that alone waits longer than the target:
    then its percentile is not an old breach counted twice but one the change did not cure, and waiting a
    whole window more for it (the warm-up rule) costs another pod start on a cold cluster hit by a burst."""
    return ready >= current and wait is not None and target is not None and wait > target


def backlog_clears(queue_now: float | None, rate: float | None, work: float | None, ready: int,
                   horizon: float | None) -> bool:
    """Whether the pool as it stands now works off its queue within `horizon` seconds while keeping up with
    arrivals: `ready - λ·work` instances are left over for a backlog of `queue·work` instance-seconds
    (`work`: one request's instance-seconds, len/C). A pod ordered now is ready a pod start later; if the
    pool drains the queue before the guard looks again (a window), what it would order arrives after the
    breach is over and stays for a stabilization period (a shift to 6k-token prompts met by 1 prefill
    instance: 3 -> 7 -> 11 while the 7 just ready drained the queue in 25 s). Unknown: False (act)."""
    if queue_now is None or rate is None or work is None or horizon is None:
        return False
    if not all(math.isfinite(v) for v in (queue_now, rate, work, horizon)) or rate <= 0 or work <= 0:
        return False
    spare = ready - rate * work
    return spare > 0 and max(0.0, queue_now) * work <= spare * horizon


def backlog_need(queue_now: float | None, queue_before: float | None, seconds: float | None, ready: int,
                 work: float | None, target: float | None, horizon: float | None) -> float | None:
    """Instances a pool needs, read from its queue gauge at two scrapes `seconds` apart, when the queue is
    growing and already waits longer than `target` (None otherwise: nothing for the fast path to do).

    While its queue is never empty the ready pool serves `ready/work` requests/s (`work`: one request's
    instance-seconds at the formula's capacity), so arrivals run at `ready/work + Δq/Δt`: keeping up takes
    `ready + work·Δq/Δt` instances, and working off the backlog now within `horizon` (a window, as
    `backlog_clears`) `queue·work/horizon` more; at least one more than the ready pool, which the growing
    queue shows is short. "Waits longer than the target": the ready pool needs `queue·work/ready` seconds
    for the backlog alone, a lower bound of what its last request waits. A queue empty at the scrape before
    (a burst's first seconds) gives an upper bound of the arrivals (the pool was not busy all along). A queue
    that shrinks or stays is left to the windowed decision. An instant gauge needs no window: this is what
    a loop every few seconds can read without waiting for a rate over a window to fill."""
    if queue_now is None or queue_before is None or seconds is None or work is None or target is None \
            or horizon is None:
        return None
    if not all(math.isfinite(v) for v in (queue_now, queue_before, seconds, work, target, horizon)):
        return None
    if seconds <= 0 or work <= 0 or horizon <= 0 or ready < 1 or queue_before < 0 or queue_now <= queue_before:
        return None
    if queue_now * work / ready <= target:
        return None
    return max(ready + 1.0, ready + work * (queue_now - queue_before) / seconds + queue_now * work / horizon)


def gauges_predate(ready_at: float | None, now: float, scrape_seconds: float) -> bool:
    """Whether the last two scrapes of a gauge may predate the pool's last change becoming ready (`ready_at`):
    the latest scrape is up to one scrape interval old, the one before two. Its queue then grew in front of
    the pool without the new instances, and the growth it shows is arrivals those instances already serve
    (a burst met by 2 prefill instances: 4 ready at 580 s, the queue still growing in the scrapes of 564 and
    576 s, read as a need of 8)."""
    return ready_at is not None and now - ready_at < 2 * scrape_seconds


def capacity_cut(scale: float, changed_within_window: bool) -> float:
    """The capacity correction after an SLO-guard step. A breach under a pool that stood at its size for the
    whole window says the capacity the formula believes in is too high: cut it (SLO_CAPACITY_CUT). A breach
    in a window during which the pool changed is a backlog left from before the change (the pool was
    short, or its pods were starting): the guard still drains it, but it says nothing about what one
    instance serves, and a cut there inflated every later need until it faded (a cold start met by one
    prefill instance: 4 prefill instead of 3 for ten minutes after the backlog was gone)."""
    if changed_within_window:
        return scale
    return max(MIN_CAPACITY_SCALE, scale * SLO_CAPACITY_CUT)


def guard_step(current: int, observed: float | None, target: float | None, wait: float | None = None,
               wait_now: float | None = None) -> int:
    """Replicas the SLO guard adds: in proportion to how far the percentile is over its target (HPA's
    current x metric/target), at least one; `maxScaleUpStep` caps it. One replica per window was too slow
    for a burst (Azure, no history: p99 TTFT 77 s against 5 s took three windows to grow 3 -> 5).
    With the queue's mean `wait` known, only the part of the percentile a queue explains counts (target +
    wait at most): prompts too long for the target on any pool size break the percentile by 3x (Mooncake-
    schema traces, 5 % of prompts over 50k tokens) while the queue adds a second, and a step of 2x the pool
    for them buys nothing. With the queue grown past its mean (`wait_now` > `wait`: a backlog building), the
    wait it adds now counts at least (target + wait_now): the percentile lags a backlog whose requests have
    no first token yet (a shift to long outputs: p99 8 s while the decode queue already meant 7.5 s)."""
    if not observed or not target or not math.isfinite(observed) or observed <= target:
        return 1
    if wait is not None and math.isfinite(wait):
        observed = min(observed, target + wait)
    if wait_now is not None and math.isfinite(wait_now) and (wait is None or wait_now > wait):
        observed = max(observed, target + wait_now)
    return max(1, math.ceil(current * observed / target - 1e-9) - current)


def pool_need(rate: float, peak: float | None, work: float, headroom: float, spread: float) -> tuple[float, float]:
    """(need, burst need) in instances, unrounded: `work` is one request's instance-seconds (len/C). The
    mean rate with headroom, or the peak burst rate spread over b + TTFT without headroom (the peak is
    already the worst case), whichever is larger."""
    burst = (peak or 0.0) * work * spread
    return max(headroom * rate * work, burst), burst


def breached(observed: float | None, target: float | None) -> bool:
    return target is not None and observed is not None and math.isfinite(observed) and observed > target


def comfortable(observed: float | None, target: float | None) -> bool:
    return target is None or observed is None or observed <= SLO_COMFORT * target


class NeedWindow:
    """Recent (time, need) samples within the stabilization period, oldest first."""

    def __init__(self, samples: Iterable[tuple[float, float]] = ()) -> None:
        self.samples = sorted((float(t), float(n)) for t, n in samples)

    def add(self, now: float, need: float, keep_seconds: float) -> NeedWindow:
        kept = [(t, n) for t, n in self.samples if now - t < keep_seconds and t <= now]
        kept.append((now, need))
        if len(kept) <= MAX_NEED_SAMPLES:
            return NeedWindow(kept)
        width = keep_seconds / (MAX_NEED_SAMPLES - 1)
        buckets: dict[int, tuple[float, float]] = {}
        for t, n in kept:
            k = math.floor(t / width)
            t0, n0 = buckets.get(k, (t, n))
            buckets[k] = (max(t0, t), max(n0, n))
        return NeedWindow(list(buckets.values())[-MAX_NEED_SAMPLES:])

    def peak(self) -> float | None:
        return max((n for _, n in self.samples), default=None)

    def as_tuple(self) -> tuple[tuple[float, float], ...]:
        return tuple(self.samples)


def join_cost(join_mean: float | None, step_mean: float | None) -> float | None:
    """t_join from the decode workers' mean `pdcluster_decode_join_seconds` (a request's KV complete -> its
    first output) and mean decode step (`pdcluster_time_per_output_token_seconds` of the decode workers).
    The first output leaves with the step that carries the request, a step whose tokens O/C_d already counts,
    so one step is taken off; what remains is import, scheduling and the wait for the step in progress (an
    upper bound of the work: under load that wait grows with the step). No step series -> the whole
    admission time; no admission series -> None (unknown)."""
    if join_mean is None or not math.isfinite(join_mean):
        return None
    step = step_mean if step_mean is not None and math.isfinite(step_mean) and step_mean > 0 else 0.0
    return max(0.0, join_mean - step)


def join_seconds(observed: float | None, capacity_source: str, configured: float | None = None) -> float:
    """t_join in the decode need `λ·(O/C_d + t_join)`, counted only with a configured C_d (a learned one is
    the output tok/s of saturated windows, joins included, so adding t_join would count them twice). A
    configured t_join (`pdcluster profile --stream-rate`: the decode instance-seconds per request under
    arrivals less O/C_d, what `pdcluster plan --decode-join-seconds` takes) wins: it is a cost, where the live
    series is a latency (a transferred request's KV complete -> its first output) that queueing inflates and
    that leaves out work done before the KV is complete. Else the observed mean. Missing, NaN or negative ->
    0: the formula without the term."""
    if capacity_source != "spec":
        return 0.0
    if configured is not None and math.isfinite(configured) and configured >= 0:
        return configured
    if observed is None or not math.isfinite(observed) or observed <= 0:
        return 0.0
    return observed
