"""A backlog the ready pool works off before the guard looks again grows nothing, and a breach left from
before a change does not cut the capacity the formula believes in (`autoscaler_rules.backlog_clears`,
`autoscaler_rules.capacity_cut`). The figures are those of the `shift` trace, primed: 4 req/s of 6k-token
prompts met by one prefill instance (10k tok/s each), grown 1 -> 3 -> 7 -> 11 before this rule."""

from __future__ import annotations

import pytest

from pdcluster.operator import autoscaler as asc
from pdcluster.operator import autoscaler_guard as slo_guard
from pdcluster.operator import autoscaler_rules as rules

from .test_autoscaler_guards import obs, policy

WORK = 0.6  # instance-seconds of a 6k-token prompt at 10k tok/s


def test_backlog_clears_is_the_spare_capacity_against_the_queue() -> None:
    # 7 ready, 2.53 of them busy with arrivals: 184 queued prompts (110 instance-seconds) go in 25 s
    assert rules.backlog_clears(184.0, 4.22, WORK, 7, 120.0)
    # 3 ready, 0.59 spare: 198 queued prompts take 200 s, longer than the window
    assert not rules.backlog_clears(198.0, 4.02, WORK, 3, 120.0)
    assert rules.backlog_clears(198.0, 4.02, WORK, 3, 210.0)  # ... within a longer horizon
    # no spare at all: the queue only grows
    assert not rules.backlog_clears(1.0, 5.0, WORK, 3, 120.0)
    # no queue: nothing to work off
    assert rules.backlog_clears(0.0, 4.0, WORK, 3, 120.0)
    # unknown: act (the rule only ever holds the guard back on evidence)
    for args in ((None, 4.0, WORK, 7, 120.0), (184.0, None, WORK, 7, 120.0), (184.0, 4.0, None, 7, 120.0),
                 (184.0, 4.0, WORK, 7, None), (float("nan"), 4.0, WORK, 7, 120.0), (184.0, 0.0, WORK, 7, 120.0)):
        assert not rules.backlog_clears(*args)


def test_work_is_one_requests_instance_seconds_at_the_formulas_capacity() -> None:
    pol = policy()
    o = obs(4.0, i=6000, o=900, prefix_hit_rate=0.5)
    assert slo_guard.work(pol, o, asc.PoolState(), "prefill") == pytest.approx(3000 / 10000)
    assert slo_guard.work(pol, o, asc.PoolState(capacity_scale=0.5), "decode") == pytest.approx(900 / 1000)
    assert slo_guard.work(policy(prefill_capacity=None), o, asc.PoolState(), "prefill") is None  # unknown C_p
    assert slo_guard.work(policy(prefill_capacity=None), o, asc.PoolState(learned_capacity=5000.0),
                          "prefill") == pytest.approx(0.6)
    assert slo_guard.work(pol, None, asc.PoolState(), "prefill") is None


def _shift_window(queue: float, rate: float) -> asc.Observation:
    # a smooth rate (the peak 10 s rate close to the mean): the formula asks for 3 (2.4 busy, little headroom)
    return obs(rate, i=6000, o=20, peak_request_rate=1.1 * rate, ttft_seconds=79.5, prefill_queue_mean=queue,
               prefill_queue_now=queue)


def test_the_guard_leaves_a_backlog_the_pods_just_ready_drain() -> None:
    pol = policy(slo_ttft_seconds=5.0, max_up_step=4)
    state = asc.State(prefill=asc.PoolState(last_change=90.0))
    # 150 s: the 7 ordered at 90 s are ready, the queue still 184 long (they have served nothing yet)
    dec = asc.decide(pol, state, _shift_window(184.0, 4.22), asc.PoolView(7, 7), asc.PoolView(1, 1), 150.0)
    assert dec.prefill.desired == 7 and dec.prefill.reason != asc.SLO_GUARD
    assert dec.state.prefill.slo_breaches == 0
    # the same queue in front of 3 ready instances outlasts the window: the guard grows the pool now
    dec = asc.decide(pol, state, _shift_window(198.0, 4.02), asc.PoolView(3, 3), asc.PoolView(1, 1), 150.0)
    assert dec.prefill.reason == asc.SLO_GUARD and dec.prefill.desired == 7
    # a pool that stood at its size, ready, for the whole window: the rule does not apply (the window shows it)
    stood = asc.State(prefill=asc.PoolState(last_change=0.0, ready_at=0.0))
    dec = asc.decide(pol, stood, _shift_window(184.0, 4.22), asc.PoolView(7, 7), asc.PoolView(1, 1), 150.0)
    assert dec.prefill.reason == asc.SLO_GUARD


def test_capacity_cut_only_for_a_breach_under_a_pool_that_stood() -> None:
    assert rules.capacity_cut(1.0, changed_within_window=True) == 1.0
    assert rules.capacity_cut(0.8, changed_within_window=True) == 0.8
    assert rules.capacity_cut(1.0, changed_within_window=False) == rules.SLO_CAPACITY_CUT
    assert rules.capacity_cut(rules.MIN_CAPACITY_SCALE, False) == rules.MIN_CAPACITY_SCALE


def test_a_backlog_left_from_before_a_change_grows_the_pool_but_keeps_the_capacity() -> None:
    pol = policy(slo_ttft_seconds=5.0, max_up_step=4)
    # 90 s: the 3 ordered at 30 s are ready, the backlog of the one-instance start still there
    changed = asc.State(prefill=asc.PoolState(last_change=30.0))
    dec = asc.decide(pol, changed, _shift_window(198.0, 4.02), asc.PoolView(3, 3), asc.PoolView(1, 1), 90.0)
    assert dec.prefill.reason == asc.SLO_GUARD and dec.prefill.desired > 3
    assert dec.state.prefill.capacity_scale == 1.0 and dec.state.prefill.slo_breaches == 1
    # the same breach under 3 instances that stood for the whole window: the capacity is in question
    stood = asc.State(prefill=asc.PoolState(last_change=-600.0, ready_at=-540.0))
    dec = asc.decide(pol, stood, _shift_window(198.0, 4.02), asc.PoolView(3, 3), asc.PoolView(1, 1), 90.0)
    assert dec.prefill.reason == asc.SLO_GUARD
    assert dec.state.prefill.capacity_scale == pytest.approx(rules.SLO_CAPACITY_CUT)


def test_note_ready_keeps_when_the_last_change_was_first_seen_ready() -> None:
    ps = asc.PoolState(last_change=210.0)
    assert slo_guard.note_ready(ps, asc.PoolView(7, 3), 300.0) is ps  # still starting
    ready = slo_guard.note_ready(ps, asc.PoolView(7, 7), 390.0)
    assert ready.ready_at == 390.0
    assert slo_guard.note_ready(ready, asc.PoolView(7, 7), 420.0).ready_at == 390.0  # the first sighting stays
    later = asc.PoolState(last_change=500.0, ready_at=390.0)  # a newer change: seen ready afresh
    assert slo_guard.note_ready(later, asc.PoolView(6, 6), 530.0).ready_at == 530.0
    assert slo_guard.note_ready(asc.PoolState(), asc.PoolView(2, 2), 10.0).ready_at is None  # never changed


def test_pods_slower_than_a_window_count_from_when_they_are_ready() -> None:
    # pods that start in 180 s (longer than the 120 s window): ordered at 210 s, ready at 390 s. The window
    # since the order is over, but the one ending at 390 s holds the backlog of the 3 the 7 replace.
    pol = policy(slo_ttft_seconds=5.0, max_up_step=4)
    view = asc.PoolView(7, 7)
    ps = slo_guard.note_ready(asc.PoolState(last_change=210.0), view, 390.0)
    assert slo_guard.changed_within_window(pol, ps, view, 390.0)
    assert not slo_guard.changed_within_window(pol, ps, view, 511.0)
    assert slo_guard.changed_within_window(pol, asc.PoolState(last_change=500.0), view, 511.0)
    assert slo_guard.changed_within_window(pol, asc.PoolState(last_change=0.0), asc.PoolView(7, 5), 511.0)
    # the decision at 390 s: 71 queued, 7 ready of which 2.4 busy with arrivals -> gone in 9 s: no step
    window = obs(3.95, i=6000, o=20, peak_request_rate=4.3, ttft_seconds=78.6, prefill_queue_mean=120.0,
                 prefill_queue_now=71.0)
    state = asc.State(prefill=asc.PoolState(last_change=210.0, ready_at=150.0))
    dec = asc.decide(pol, state, window, view, asc.PoolView(1, 1), 390.0)
    assert dec.prefill.desired == 7 and dec.state.prefill.ready_at == 390.0
    # counted from the order alone (before `ready_at`), the guard grew the 7 to 11
    assert rules.warming_up(390.0, 210.0, None, 7, 7, 120.0) is False


def test_ready_at_survives_the_status_round_trip() -> None:
    from pdcluster.operator import status

    state = asc.State(prefill=asc.PoolState(last_change=1_700_000_000.0, ready_at=1_700_000_180.0))
    back = status.autoscaler_state(status.autoscaler_state_status(state))
    assert back.prefill.ready_at == pytest.approx(1_700_000_180.0) and back.decode.ready_at is None
    assert status.autoscaler_state({"readyTime": {"prefill": "junk"}}).prefill.ready_at is None
    assert status.autoscaler_state({"readyTime": "junk"}).prefill.ready_at is None
