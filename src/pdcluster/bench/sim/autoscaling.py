"""The simulated operator's autoscaler loop: when `pdcluster simulate`'s policy is asked, what it sees, and
how its answer reaches the pools (`cluster.py` holds the pools and the request path).

- Ticks: every `interval_s` the policy sees what Prometheus would show (`observe.py`) and sets the pool
  sizes (`Cluster.set_size`), after the role flips it chose (`Cluster.flip`); one timeline row per answer.
- The fast path (`operator/autoscaler_fast.py`): a policy with `fast_s` sees the queue gauges as last
  sampled every `fast_s` between ticks.
- The short-window flip step (`operator/autoscaler_flip_window.py`): a policy with `flip_window_s` sees the
  last `flip_window_s` of rate, lengths and queues at each tick, and every `flip_tick_s` between ticks
  (counters are then sampled at those moments too, so the window is exact).
- Scrapes (`ServiceModel.scrape_s`, `simulate --scrape-interval`): the counters are sampled on their own grid
  instead, and every step reads them as of the last scrape, as Prometheus answers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdcluster.bench.sim.observe import PolicyInput
from pdcluster.operator.autoscaler import PoolView

if TYPE_CHECKING:
    from pdcluster.bench.sim.cluster import Cluster

# the events of the loop (cluster.py's event kinds)
TICK = 5  # a decision
FAST = 8  # the fast scale-up path between two ticks
FLIPW = 9  # the short-window flip step between two ticks
SCRAPE = 10  # Prometheus scrapes the counters (with `ServiceModel.scrape_s`; else each step reads them exactly)


def start(c: Cluster) -> None:
    """The first events of the loop, at the start of a run."""
    if c.interval_s <= c.horizon:
        c.push(c.interval_s, TICK)
    if 0 < c.fast_s <= c.horizon:
        c.push(c.fast_s, FAST)
    if c.flipw_s and 0 < c.flipw_tick_s < c.interval_s:
        c.push(c.flipw_tick_s, FLIPW)
    if c.m.scrape_s:
        c.push(c.m.scrape_s / 2, SCRAPE)


def _record(c: Cluster, now: float) -> None:
    """The counters as of `now` (the decode pool's fluid progress brought up to date first)."""
    for inst in c.pools["decode"].instances:
        if inst.ended is None:
            c.advance(inst, now)
    c.sampler.record_counters(now, c.c)


def scrape(c: Cluster, now: float) -> None:
    """A Prometheus scrape: what the next steps read until the one after it."""
    _record(c, now)
    if now + c.m.scrape_s <= c.horizon:
        c.push(now + c.m.scrape_s, SCRAPE)


def tick(c: Cluster, now: float) -> None:
    """A decision: the policy sees the window (and the flip window) as Prometheus would show it."""
    if not c.m.scrape_s:
        _record(c, now)
    p, d = c.pools["prefill"], c.pools["decode"]
    inp = PolicyInput(
        now=now,
        observation=c.sampler.observation(now, p.reporting(), d.reporting()),
        prefill_current=p.desired, prefill_ready=p.ready_count(),
        decode_current=d.desired, decode_ready=d.ready_count(),
        prefill_utilisation=c.sampler.utilisation(now, "prefill", p.reporting(), c.m.prefill_tps),
        decode_utilisation=c.sampler.utilisation(now, "decode", d.reporting(), c.m.decode_tps),
        short_observation=c.sampler.short(now, c.flipw_s) if c.flipw_s else None,
        prefill_inflight_tokens=float(c.pqueued_tokens),
        decode_occupancy=sum(i.n for i in d.instances if i.ready and i.ended is None) / c.m.decode_batch,
    )
    apply(c, c.policy.decide(inp), now, inp.observation.request_rate or 0.0 if inp.observation else 0.0)
    if now + c.interval_s <= c.horizon:
        c.push(now + c.interval_s, TICK)


def apply(c: Cluster, want: tuple[int, int], now: float, rate: float) -> None:
    """Carry out a decision: the flips the policy chose first, then the pools' new sizes; one timeline row."""
    to_prefill, to_decode = getattr(c.policy, "pending_flips", (0, 0))
    if to_prefill:
        c.flip("decode", "prefill", to_prefill, now)
    if to_decode:
        c.flip("prefill", "decode", to_decode, now)
    for role, n in zip(("prefill", "decode"), want, strict=True):
        if n != c.pools[role].desired:
            c.scale_events += 1
            c.set_size(role, n, now)
    p, d = c.pools["prefill"], c.pools["decode"]
    c.timeline.append((now, p.desired, d.desired, p.ready_count(), d.ready_count(), rate))


def fast_tick(c: Cluster, now: float) -> None:
    """The fast path (`operator/autoscaler_fast.py`) between two ticks: the queue gauges as last sampled."""
    k = round(now / c.interval_s)
    if abs(now - k * c.interval_s) > 1e-6:  # a tick at the same moment decides on its own
        p, d = c.pools["prefill"], c.pools["decode"]
        views = (PoolView(p.desired, p.ready_count(), since=0.0), PoolView(d.desired, d.ready_count(), since=0.0))
        want = c.policy.fast(now, c.sampler.gauges(), *views)
        if want is not None:
            apply(c, want, now, c.timeline[-1][5] if c.timeline else 0.0)
    if now + c.fast_s <= c.horizon:
        c.push(now + c.fast_s, FAST)


def flip_tick(c: Cluster, now: float) -> None:
    """The short-window flip step between two ticks (a tick at the same moment runs it itself)."""
    k = round(now / c.interval_s)
    if abs(now - k * c.interval_s) > 1e-6:
        if not c.m.scrape_s:
            _record(c, now)
        p, d = c.pools["prefill"], c.pools["decode"]
        views = (PoolView(p.desired, p.ready_count(), since=0.0), PoolView(d.desired, d.ready_count(), since=0.0))
        want = c.policy.flip_window(now, c.sampler.short(now, c.flipw_s), *views)
        if want is not None:
            apply(c, want, now, c.timeline[-1][5] if c.timeline else 0.0)
    if now + c.flipw_tick_s <= c.horizon:
        c.push(now + c.flipw_tick_s, FLIPW)
