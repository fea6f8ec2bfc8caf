"""Decode judges a TTFT breach by its queue building now as well as by the window's mean queue
(`autoscaler_rules.queue_in_front`); prefill keeps the mean. The figures are the `shift` trace's (seed 3,
cold) at 1230 s, 30 s after the mix turned to 900-token outputs: one decode instance, its queue 24 requests
at the window's end and 3.8 on average over it (a mean wait of 0.98 s against the 1 s `guard_applies` asks)."""

from __future__ import annotations

from pdcluster.operator import autoscaler as asc
from pdcluster.operator import autoscaler_rules as rules

from .test_autoscaler_guards import obs, policy


def test_queue_in_front_is_the_mean_or_the_queue_building_now() -> None:
    assert rules.queue_in_front(3.8, 24.0) == 24.0
    assert rules.queue_in_front(3.8, 2.0) == 3.8  # draining: the window's mean
    assert rules.queue_in_front(3.8, None) == 3.8 and rules.queue_in_front(None, None) is None
    assert rules.queue_in_front(None, 5.0) == 5.0
    assert rules.queue_in_front(3.8, float("nan")) == 3.8


def turn(**kw) -> asc.Observation:
    base = dict(i=4750, o=129, ttft_seconds=8.78, tpot_seconds=0.0191, peak_request_rate=5.4,
                prefill_queue_mean=1.3, prefill_queue_now=0.0, decode_queue_mean=3.8, decode_queue_now=24.0)
    base.update(kw)
    return obs(3.89, **base)


def test_a_decode_queue_building_at_the_windows_end_grows_decode_now() -> None:
    pol = policy(slo_ttft_seconds=5.0, slo_tpot_seconds=0.1, max_up_step=4)
    stood = asc.State(decode=asc.PoolState(last_change=0.0, ready_at=0.0))
    d = asc.decide(pol, stood, turn(), asc.PoolView(3, 3), asc.PoolView(1, 1), 1230.0)
    assert d.decode.reason == asc.SLO_GUARD and d.decode.desired >= 2
    # the same mean queue, not building (the queue now below it): a window's mean wait under 1 s grows nothing
    d = asc.decide(pol, stood, turn(decode_queue_now=2.0), asc.PoolView(3, 3), asc.PoolView(1, 1), 1230.0)
    assert d.decode.reason != asc.SLO_GUARD and d.decode.desired == 1


def test_prefill_keeps_the_windows_mean() -> None:
    # a prefill queue of 24 at the window's end after a mean of 0.6 (a couple of 100k-token prompts holding
    # instances): judged by the mean, it grows nothing
    pol = policy(slo_ttft_seconds=5.0, max_up_step=4)
    stood = asc.State(prefill=asc.PoolState(last_change=0.0, ready_at=0.0))
    o = obs(3.89, i=6000, o=20, ttft_seconds=12.0, peak_request_rate=4.3, prefill_queue_mean=0.6,
            prefill_queue_now=24.0)
    d = asc.decide(pol, stood, o, asc.PoolView(4, 4), asc.PoolView(1, 1), 1230.0)
    assert d.prefill.reason != asc.SLO_GUARD
