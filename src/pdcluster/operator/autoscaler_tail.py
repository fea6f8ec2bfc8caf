"""Pure: the prefill instances a heavy tail of prompt lengths asks for, which the mean-rate formula cannot see.

A prefill instance serves one prompt at a time, so a 40k-token prompt holds it for 4 s at 10k tok/s and
every prompt that arrives meanwhile waits unless another instance is free. `h·λ·I'/C_p` sizes the pool
for the mean work with a headroom that follows the *rate's* variability; with prompt lengths whose squared
coefficient of variation (SCV) is 2 (Mooncake-schema conversation traces: 5 % of prompts over 50k tokens),
0.77 instances of mean load at 1-2 instances left the p99 TTFT at 9-13 s while the mean queue stayed under
half a request (too little for the SLO guard), and llm-d's token-aware KEDA, which counts seconds of
prompt tokens in flight, held 3-4 instances and met more requests for no more instance-hours.

The queueing answer: the prefill pool is an M/G/c queue (Poisson arrivals at λ, service S = I'/C_p with
the prompts' SCV, c instances, one shared FCFS queue: the router sends to the least-loaded worker). With
Erlang C's chance that a prompt waits at all, and the Allen–Cunneen scaling of the M/M/c wait by
(1 + SCV)/2, a prompt waits longer than t with probability about

    P(W > t) = C(c, a) · exp(-(c/E[S] - λ) · t · 2/(1 + SCV)),    a = λ·E[S]

and the pool needs the smallest c at which that is at most 1 - the SLO percentile, for t the TTFT target
less the mean prompt's own prefill. Between two instance counts the need is interpolated on log P, so a
pool that needs "2.4" keeps scale-down's margin arithmetic (`replicas_for(need · 1.1)`) meaningful. The
SCV comes from the router's `pdcluster_request_prompt_tokens` histogram (`histogram_scv`): no new series.
`decide` asks at the rate the pool serves within the target, max(λ, λ_peak·b/(b+TTFT)), and only past an SCV
of 1 (`MIN_SCV`): on a steady 6k-token mix (SCV 0.04) at 2.6 instances of load the answer is 2.9, which the
scale-down margin reads as a fourth instance the formula's three never needed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdcluster.operator.autoscaler import Observation, Policy

# Past this many instances over the offered load the search stops (a budget too small for any pool size:
# the prompt itself is longer than the target, which more instances do not shorten).
MAX_EXTRA = 64
# Past this many instances of load the search is skipped (None: the formula stands): Erlang C costs O(c) per
# count, and a pool that large is sized by its mean already (the tail need tends to a + O(sqrt(a)), within any
# headroom), so a bad observation never buys the operator a long computation.
MAX_LOAD = 1024.0
# The formula's headroom was chosen on loads whose service is no more variable than exponential (the Azure
# code trace's prompts: SCV 0.93; a steady mix: 0.04), and there it already covers the queueing: the rule
# adds instances only past it (Mooncake conversation 1.72, the synthetic conversation seeds 1.9-2.2).
MIN_SCV = 1.0
# The SCV is read over a longer range than the rate: the prompt-length mix is a slow property of the workload,
# and the 100-odd prompts of a 2-minute window at 1 req/s put an SCV of 2 anywhere from 1.4 to 2.8.
SCV_WINDOW_SECONDS = 600.0


def _erlang_b(a: float, upto: int) -> Iterator[tuple[int, float]]:
    """(c, Erlang B of c servers at offered load `a`) for c = 1..upto, by the stable recurrence."""
    b = 1.0
    for k in range(1, upto + 1):
        b = a * b / (k + a * b)
        yield k, b


def _c_from_b(c: int, a: float, b: float) -> float:
    return b / (1.0 - a / c * (1.0 - b))


def erlang_c(c: int, a: float) -> float:
    """The chance that an arrival waits in an M/M/c queue with offered load `a` (Erlangs); 1 when a >= c."""
    if c <= 0 or a >= c:
        return 1.0
    if a <= 0:
        return 0.0
    *_, (_, b) = _erlang_b(a, c)  # c >= 1 here: the last of a nonempty run
    return _c_from_b(c, a, b)


def _wait_beyond(c: int, rate: float, service: float, scv: float, t: float, waits: float) -> float:
    """P(W > t) given `waits`, the Erlang C of `c` instances (c above the load)."""
    decay = (c / service - rate) * 2.0 / (1.0 + max(0.0, scv))
    return waits * math.exp(-decay * max(0.0, t))


def wait_beyond(c: int, rate: float, service: float, scv: float, t: float) -> float:
    """P(W > t) in an M/G/c queue: Erlang C with the Allen–Cunneen (1 + SCV)/2 scaling of the exponential tail."""
    a = rate * service
    if c <= a:
        return 1.0
    return _wait_beyond(c, rate, service, scv, t, erlang_c(c, a))


def tail_need(rate: float, service: float, scv: float | None, budget: float, miss: float) -> float | None:
    """Instances (unrounded) for at most `miss` of prompts to wait longer than `budget` seconds, at `rate`
    req/s of `service` instance-seconds each with prompt-length SCV `scv`. None when it cannot be computed or
    cannot help: unknown SCV, no load, a budget the mean prompt's own prefill already spends, or no count
    within MAX_EXTRA instances of the load meets it."""
    if scv is None or not all(math.isfinite(x) for x in (rate, service, scv, budget, miss)):
        return None
    if rate <= 0 or service <= 0 or budget <= 0 or not 0 < miss < 1 or scv <= MIN_SCV:
        return None
    a = rate * service
    if a > MAX_LOAD:
        return None
    prev_c, prev_p = a, 1.0  # at c = a the queue is unstable: every prompt waits
    first = max(1, math.floor(a) + 1)
    # Erlang B steps from one count to the next: one pass over the counts, not one per count tried
    for c, b in _erlang_b(a, math.floor(a) + MAX_EXTRA):
        if c < first:
            continue
        p = _wait_beyond(c, rate, service, scv, budget, _c_from_b(c, a, b))
        if p <= miss:
            if p <= 0.0 or prev_p <= p:
                return float(c)
            # log-linear between the last count that missed and this one
            frac = (math.log(prev_p) - math.log(miss)) / (math.log(prev_p) - math.log(p))
            return prev_c + (c - prev_c) * frac
        prev_c, prev_p = float(c), p
    return None


def pool_tail(policy: Policy, obs: Observation | None, rate: float, service: float) -> float | None:
    """The prefill pool's tail need (`tail_need`) at `rate` req/s of `service` instance-seconds each, with the
    policy's TTFT target (the budget: the target less the mean prompt's own prefill) and percentile (the share
    of prompts that may wait longer); None with the rule off, no TTFT target or no SCV observed."""
    if not policy.tail_need or not policy.slo_ttft_seconds or obs is None:
        return None
    return tail_need(rate, service, obs.prompt_length_scv, policy.slo_ttft_seconds - service,
                     1.0 - policy.slo_percentile)


def histogram_scv(buckets: Sequence[tuple[float, float]]) -> float | None:
    """The squared coefficient of variation of a histogram's values from its cumulative buckets `(le, count)`
    (Prometheus's layout, `+Inf` included or not), each bucket's values taken as uniform between its bounds (the
    `+Inf` bucket at the highest finite bound, as `histogram_quantile` answers). None without two values' worth
    of counts or with a mean of 0."""
    rows = sorted((le, n) for le, n in buckets if math.isfinite(n) and not math.isnan(le))
    total = m1 = m2 = 0.0
    lo, below = 0.0, 0.0
    finite = [le for le, _ in rows if math.isfinite(le)]
    top = finite[-1] if finite else None
    for le, cum in rows:
        n = max(0.0, cum - below)
        below = max(below, cum)
        hi = le if math.isfinite(le) else top
        if hi is None:
            return None
        if n > 0:
            mean = (lo + hi) / 2.0
            sq = (lo * lo + lo * hi + hi * hi) / 3.0
            total, m1, m2 = total + n, m1 + n * mean, m2 + n * sq
        lo = hi
    if total <= 0 or m1 <= 0:
        return None
    mu = m1 / total
    return max(0.0, m2 / total / (mu * mu) - 1.0)
