"""The fast scale-up path on queue gauges between two decisions (`autoscaler_rules.backlog_need`,
`autoscaler_fast.fast_decide`): a growing queue that already waits past the TTFT target grows the pool to
what its growth says arrivals need, a scrape late; anything else is left to `decide`."""

from __future__ import annotations

import pytest

from pdcluster.operator import autoscaler as asc
from pdcluster.operator import autoscaler_fast as fast
from pdcluster.operator import autoscaler_rules as rules
from pdcluster.operator.autoscaler_ratio import RatioBounds
from pdcluster.operator.planner import Bounds

from .test_autoscaler_guards import obs, policy

WORK = 0.2  # instance-seconds of a 2k-token prompt at 10k tok/s


def test_backlog_need_is_the_arrivals_the_growth_shows_plus_the_backlog_in_a_window() -> None:
    # 3 ready serve 15 req/s; the queue grew 40 -> 100 in 15 s: arrivals 19 req/s, 3.8 instances, and the
    # backlog of 100 (20 instance-seconds) in 120 s one sixth more
    need = rules.backlog_need(100.0, 40.0, 15.0, 3, WORK, 5.0, 120.0)
    assert need == pytest.approx(max(4.0, 3 + WORK * 60 / 15 + 100 * WORK / 120))
    assert rules.backlog_need(250.0, 40.0, 15.0, 3, WORK, 5.0, 120.0) == pytest.approx(
        3 + WORK * 210 / 15 + 250 * WORK / 120)
    # empty at the scrape before (a burst's first seconds): the growth is an upper bound of the arrivals,
    # and the backlog already waits past the target
    assert rules.backlog_need(100.0, 0.0, 15.0, 3, WORK, 5.0, 120.0) == pytest.approx(
        3 + WORK * 100 / 15 + 100 * WORK / 120)


def test_a_growing_queue_is_at_least_one_instance_short() -> None:
    # a slow growth still says the ready pool is short: one more at least
    assert rules.backlog_need(100.0, 99.0, 15.0, 3, WORK, 5.0, 120.0) == 4.0


@pytest.mark.parametrize(("now", "before"), [
    (100.0, 120.0),  # shrinking: the pool is working it off
    (100.0, 100.0),  # flat
    (60.0, 40.0),  # growing, but 60 x 0.2 s on 3 instances is 4 s: within the 5 s target
])
def test_backlog_need_leaves_a_queue_that_is_not_growing_past_the_target_alone(now, before) -> None:
    assert rules.backlog_need(now, before, 15.0, 3, WORK, 5.0, 120.0) is None


@pytest.mark.parametrize("args", [
    (None, 40.0, 15.0, 3, WORK, 5.0, 120.0), (100.0, None, 15.0, 3, WORK, 5.0, 120.0),
    (100.0, 40.0, None, 3, WORK, 5.0, 120.0), (100.0, 40.0, 15.0, 3, None, 5.0, 120.0),
    (100.0, 40.0, 15.0, 3, WORK, None, 120.0), (100.0, 40.0, 15.0, 3, WORK, 5.0, None),
    (float("nan"), 40.0, 15.0, 3, WORK, 5.0, 120.0), (100.0, 40.0, 0.0, 3, WORK, 5.0, 120.0),
    (100.0, 40.0, 15.0, 0, WORK, 5.0, 120.0),
])
def test_backlog_need_unknown_is_none(args) -> None:
    assert rules.backlog_need(*args) is None


def gauges(p_now: float, p_before: float, d_now: float = 0.0, d_before: float = 0.0) -> dict[str, fast.Gauges]:
    return {"prefill": fast.Gauges(p_now, p_before, 15.0), "decode": fast.Gauges(d_now, d_before, 15.0)}


LAST = obs(10.0, i=2000, o=100)  # the last windowed observation: 2k-token prompts, 100 output tokens


def test_a_growing_queue_past_the_target_grows_the_pool_between_decisions() -> None:
    pol = policy(slo_ttft_seconds=5.0, max_up_step=4)
    d = fast.fast_decide(pol, asc.State(), LAST, gauges(100.0, 40.0), asc.PoolView(3, 3), asc.PoolView(1, 1), 45.0)
    assert d is not None and d.reason == asc.SLO_GUARD
    assert d.prefill.desired == 4 and d.prefill.reason == asc.SLO_GUARD and d.prefill.slo_breached
    assert d.decode.desired == 1  # its queue is empty: untouched
    # the step counts as the pool's last change: decide waits for the rollout, stabilization starts afresh
    assert d.state.prefill.last_change == 45.0 and d.state.prefill.below_since is None
    assert d.state.prefill.slo_breaches == 1 and d.state.decode == asc.State().decode
    assert d.inputs["fastPath"] is True and d.inputs["prefillQueueNow"] == 100.0
    # a faster growth asks for more, maxScaleUpStep at most
    d = fast.fast_decide(pol, asc.State(), LAST, gauges(250.0, 40.0), asc.PoolView(3, 3), asc.PoolView(1, 1), 45.0)
    assert d is not None and d.prefill.desired == 7


def test_pods_already_starting_count_against_the_need() -> None:
    pol = policy(slo_ttft_seconds=5.0, max_up_step=4)
    # 3 ready and 2 starting: the 3.97 instances the growth asks for are already on their way
    assert fast.fast_decide(pol, asc.State(), LAST, gauges(100.0, 40.0), asc.PoolView(5, 3), asc.PoolView(1, 1),
                            45.0) is None


def test_decode_answers_for_the_first_token_too() -> None:
    # requests waiting for a decode slot have no first token: its queue growing past the TTFT target grows
    # decode (work: 100 tokens at 2000 tok/s = 0.05 instance-s; 1 ready, 300 waiting = 15 s)
    pol = policy(slo_ttft_seconds=5.0, max_up_step=4)
    d = fast.fast_decide(pol, asc.State(), LAST, gauges(0.0, 0.0, 300.0, 150.0), asc.PoolView(3, 3),
                         asc.PoolView(1, 1), 45.0)
    assert d is not None and d.prefill.desired == 3 and d.decode.desired == 2


def test_the_bounds_the_budget_and_the_ratio_apply() -> None:
    g = gauges(250.0, 40.0)
    capped = policy(slo_ttft_seconds=5.0, max_up_step=4, bounds=Bounds(1, 5, 1, 32))
    d = fast.fast_decide(capped, asc.State(), LAST, g, asc.PoolView(3, 3), asc.PoolView(1, 1), 45.0)
    assert d is not None and d.prefill.desired == 5
    budget = policy(slo_ttft_seconds=5.0, max_up_step=4, bounds=Bounds(1, 32, 1, 32, max_total=5))
    d = fast.fast_decide(budget, asc.State(), LAST, g, asc.PoolView(3, 3), asc.PoolView(1, 1), 45.0)
    assert d is not None and d.prefill.desired == 4 and "max-total-replicas" in d.limited_by
    full = policy(slo_ttft_seconds=5.0, bounds=Bounds(1, 3, 1, 32))
    assert fast.fast_decide(full, asc.State(), LAST, g, asc.PoolView(3, 3), asc.PoolView(1, 1), 45.0) is None
    ratio = policy(slo_ttft_seconds=5.0, max_up_step=4, ratio=RatioBounds(max=4.0))
    d = fast.fast_decide(ratio, asc.State(), LAST, g, asc.PoolView(3, 3), asc.PoolView(1, 1), 45.0)
    assert d is not None and d.prefill.desired == 7 and d.decode.desired == 2  # P/D at most 4


def test_without_a_ttft_target_or_a_window_seen_it_never_acts() -> None:
    g = gauges(250.0, 40.0)
    assert fast.fast_decide(policy(), asc.State(), LAST, g, asc.PoolView(3, 3), asc.PoolView(1, 1), 45.0) is None
    pol = policy(slo_ttft_seconds=5.0)
    assert fast.fast_decide(pol, asc.State(), None, g, asc.PoolView(3, 3), asc.PoolView(1, 1), 45.0) is None
    assert fast.fast_decide(pol, asc.State(), LAST, {}, asc.PoolView(3, 3), asc.PoolView(1, 1), 45.0) is None


def test_gauges_that_may_predate_the_pools_new_instances_are_not_read() -> None:
    # synthetic seed 13, cold: 2 -> 4 prefill ordered at 520 s, ready at 580 s; the scrapes of 564 and 576 s
    # show the queue growing in front of the 2 old instances, which read as a need of 8
    assert rules.gauges_predate(580.0, 580.0, 12.0) and rules.gauges_predate(580.0, 600.0, 12.0)
    assert not rules.gauges_predate(580.0, 604.0, 12.0) and not rules.gauges_predate(None, 600.0, 12.0)
    pol = policy(slo_ttft_seconds=5.0, max_up_step=4)
    changed = asc.State(prefill=asc.PoolState(last_change=520.0))
    g = gauges(250.0, 40.0)
    # the fast path notes the change ready (as `decide` does) and leaves the pool alone for two scrapes
    assert fast.fast_decide(pol, changed, LAST, g, asc.PoolView(4, 4), asc.PoolView(1, 1), 580.0) is None
    assert fast.fast_decide(pol, changed, LAST, g, asc.PoolView(4, 4), asc.PoolView(1, 1), 610.0) is None
    seen = asc.State(prefill=asc.PoolState(last_change=520.0, ready_at=580.0))  # as decide noted it
    d = fast.fast_decide(pol, seen, LAST, g, asc.PoolView(4, 4), asc.PoolView(1, 1), 610.0)
    assert d is not None and d.prefill.desired == 8 and d.state.prefill.ready_at == 580.0
