"""The SLO guard judged by the wait its queue adds: prompts too long for the TTFT on any pool size keep the
percentile broken, and neither the step nor the capacity correction may follow them; a backlog that
outlives a change is not an old breach counted twice."""

from __future__ import annotations

import pytest

from pdcluster.operator import autoscaler as asc
from pdcluster.operator import autoscaler_rules as rules

from .test_autoscaler_guards import obs, policy


def test_the_guard_step_counts_only_the_part_of_the_breach_a_queue_explains() -> None:
    # p99 TTFT 15.85 s against 5 s (Mooncake-schema: 5 % of prompts over 50k tokens) with a queue that adds
    # 1.1 s: the whole ratio asked for 2 -> 7; the queue's share asks for one more
    assert rules.guard_step(2, 15.85, 5.0) == 5
    assert rules.guard_step(2, 15.85, 5.0, wait=1.1) == 1
    # a long queue explains all of a far breach: as before
    assert rules.guard_step(3, 77.0, 5.0, wait=100.0) == rules.guard_step(3, 77.0, 5.0) == 44
    # a backlog building (the queue now past its mean): the percentile lags it, the wait now counts
    assert rules.guard_step(1, 8.4, 5.0, wait=1.06, wait_now=7.5) == 2  # 1 x (5 + 7.5)/5 = 2.5
    assert rules.guard_step(1, 8.4, 5.0, wait=1.06) == 1
    assert rules.guard_step(1, 8.4, 5.0, wait=9.0, wait_now=7.5) == 1  # draining: the mean's cap holds
    assert rules.guard_step(3, 77.0, 5.0, wait=float("nan")) == 44  # unknown wait: the percentile alone
    pol = policy(slo_ttft_seconds=5.0, max_up_step=100)
    dec = asc.decide(pol, asc.State(), obs(1.0, ttft_seconds=15.85, prefill_queue_mean=1.1), asc.PoolView(2, 2),
                     asc.PoolView(1, 1), 1000.0)
    assert dec.prefill.reason == asc.SLO_GUARD and dec.prefill.desired == 3


def test_queue_wait_is_littles_law() -> None:
    assert rules.queue_wait(6.0, 2.0) == 3.0
    assert rules.queue_wait(None, 2.0) is None and rules.queue_wait(6.0, 0.0) is None
    assert rules.queue_wait(float("inf"), 2.0) is None and rules.queue_wait(-1.0, 2.0) == 0.0


def test_a_correction_fades_while_the_breach_is_not_a_queue() -> None:
    # the percentile stays broken by prompts slower than the target on any pool, with no queue: the
    # correction made for an earlier queue fades as if the SLO were met (before: it stayed for good)
    pol = policy(slo_ttft_seconds=5.0)
    state = asc.State(prefill=asc.PoolState(capacity_scale=0.7))
    dec = asc.decide(pol, state, obs(1.0, ttft_seconds=12.0, prefill_queue_mean=0.0), asc.PoolView(3, 3),
                     asc.PoolView(1, 1), 1000.0)
    assert dec.state.prefill.capacity_scale == pytest.approx(0.7 + rules.CAPACITY_RECOVERY)
    # with a queue that waits, it does not fade (the guard fires instead and cuts it)
    dec = asc.decide(pol, state, obs(1.0, ttft_seconds=12.0, prefill_queue_mean=3.0), asc.PoolView(3, 3),
                     asc.PoolView(1, 1), 1000.0)
    assert dec.state.prefill.capacity_scale < 0.7


def test_a_backlog_longer_than_the_target_after_the_change_is_ready_is_news() -> None:
    pol = policy(slo_ttft_seconds=5.0, window_seconds=120)
    state = asc.State(prefill=asc.PoolState(last_change=1000.0))
    # 60 s after the change, its pods ready: the window still holds the old breach, but the queue alone
    # waits 50 s (> the 5 s target) and the 3 ready instances, 2.4 of them busy with arrivals (4/s x 6k
    # tokens at 10k tok/s), need 200 s for its 120 instance-seconds: the change did not cure it, so the
    # guard acts now, not a window later
    dec = asc.decide(pol, state, obs(4.0, i=6000, peak_request_rate=4.4, ttft_seconds=77.0, prefill_queue_mean=200.0),
                     asc.PoolView(3, 3),
                     asc.PoolView(1, 1), 1060.0)
    assert dec.prefill.reason == asc.SLO_GUARD and dec.prefill.desired > 3
    # a queue that adds less than the target inside the window after a change: wait for the window
    dec = asc.decide(pol, state, obs(5.0, ttft_seconds=7.0, prefill_queue_mean=10.0), asc.PoolView(3, 3),
                     asc.PoolView(1, 1), 1060.0)
    assert dec.prefill.desired == 3
    # pods still starting: never (RolloutInProgress holds the pool)
    assert not rules.backlog_outgrew(4, 3, 20.0, 5.0)
    assert rules.backlog_outgrew(3, 3, 20.0, 5.0) and not rules.backlog_outgrew(3, 3, None, 5.0)


def test_a_breach_whose_queue_has_drained_grows_nothing() -> None:
    # Azure, cold: the first burst's p99 (77 s) and mean queue (84) still fill the window at 390 s while
    # the queue drained at 330 s; growing 3 -> 7 then bought pods for a burst that was over
    pol = policy(slo_ttft_seconds=5.0)
    drained = obs(2.6, ttft_seconds=77.0, prefill_queue_mean=84.0, prefill_queue_now=0.0)
    dec = asc.decide(pol, asc.State(), drained, asc.PoolView(3, 3), asc.PoolView(1, 1), 1000.0)
    assert dec.prefill.desired == 3 and dec.prefill.slo_breached and dec.state.prefill.slo_breaches == 0
    queued = obs(2.6, ttft_seconds=77.0, prefill_queue_mean=84.0, prefill_queue_now=40.0)
    dec = asc.decide(pol, asc.State(), queued, asc.PoolView(3, 3), asc.PoolView(1, 1), 1000.0)
    assert dec.prefill.reason == asc.SLO_GUARD and dec.prefill.desired > 3
    # without the instant series (an older metrics source), the window's mean decides as before
    assert rules.still_queued(None) and rules.still_queued(float("nan")) and not rules.still_queued(0.0)


def test_a_decode_queue_that_breaks_ttft_grows_decode() -> None:
    # the load turns to long outputs: requests wait for a decode slot (TTFT 30 s against 5 s) while TPOT is
    # met (the batch bound caps the step) and O is capped by what the saturated pool generates: only the
    # decode queue says decode is short
    pol = policy(slo_ttft_seconds=5.0, slo_tpot_seconds=0.1)
    o = obs(4, i=400, o=500, ttft_seconds=30.0, tpot_seconds=0.02, prefill_queue_mean=0.0,
            decode_queue_mean=40.0, decode_queue_now=30.0)
    dec = asc.decide(pol, asc.State(), o, asc.PoolView(1, 1), asc.PoolView(2, 2), 1000.0)
    assert dec.decode.reason == asc.SLO_GUARD and dec.decode.desired > 2
    assert dec.prefill.desired == 1  # prefill had no queue: not its breach
    # the step counts the decode queue's wait (10 s): 2 x (5 + 10) / 5 = 6
    assert dec.decode.desired == 6
    # the same TTFT with no decode queue is not decode's to cure
    o = obs(4, i=400, o=500, ttft_seconds=30.0, tpot_seconds=0.02, prefill_queue_mean=0.0, decode_queue_mean=0.0)
    dec = asc.decide(pol, asc.State(), o, asc.PoolView(1, 1), asc.PoolView(2, 2), 1000.0)
    assert dec.decode.desired == 2 and dec.decode.reason != asc.SLO_GUARD


def test_a_backlog_the_ready_change_is_working_off_waits_for_the_window() -> None:
    pol = policy(slo_ttft_seconds=5.0, window_seconds=120)
    state = asc.State(decode=asc.PoolState(last_change=1000.0))

    def step(now_queue: float):
        # 10 req/s of 1100-token outputs at 2k tok/s: 5.5 of the 6 decode instances busy with arrivals
        o = obs(10.0, o=1100, peak_request_rate=10.5, ttft_seconds=40.0, decode_queue_mean=100.0,
                decode_queue_now=now_queue)
        return asc.decide(pol, state, o, asc.PoolView(1, 1), asc.PoolView(6, 6), 1060.0)

    # 60 s after decode grew to 6, its pods ready: the 60 waiting now (33 instance-seconds) go in 66 s on
    # the half instance to spare, within the window; pods ordered now would start after they are gone
    assert step(60.0).decode.desired == 6
    # 120 waiting take 132 s: the change was not enough
    assert step(120.0).decode.reason == asc.SLO_GUARD and step(120.0).decode.desired > 6
