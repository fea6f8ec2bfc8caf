"""The prefill tail need (operator/autoscaler_tail.py): M/G/c queueing at the prompt lengths' SCV, read from the
router's histogram, and how `decide` applies it."""

from __future__ import annotations

import math

import pytest

from pdcluster.operator import autoscaler as asc
from pdcluster.operator import autoscaler_explain as ex
from pdcluster.operator import autoscaler_tail as tail

from .test_autoscaler_guards import obs, policy

# 0.5 req/s of 15k-token prompts at 10k tok/s: 0.75 instances of load, 1.5 s of prefill each, 3.5 s left of a 5 s TTFT
RATE, PROMPT, WORK, BUDGET = 0.5, 15000.0, 1.5, 3.5


def test_erlang_c_against_closed_forms() -> None:
    assert tail.erlang_c(1, 0.6) == pytest.approx(0.6)  # M/M/1: an arrival waits with probability rho
    assert tail.erlang_c(2, 1.0) == pytest.approx(1 / 3)  # (a^2/2 / (1 - 1/2)) / (1 + a + 1) = 1/3
    assert tail.erlang_c(3, 3.0) == 1.0 and tail.erlang_c(3, 0.0) == 0.0


def test_wait_beyond_is_the_mm1_tail_at_scv_1_and_longer_past_it() -> None:
    # M/M/1: P(W > t) = rho exp(-(mu - lambda) t)
    rho, mu = RATE * WORK, 1 / WORK
    assert tail.wait_beyond(1, RATE, WORK, 1.0, 2.0) == pytest.approx(rho * math.exp(-(mu - RATE) * 2.0))
    assert tail.wait_beyond(1, RATE, WORK, 3.0, 2.0) > tail.wait_beyond(1, RATE, WORK, 1.0, 2.0)
    assert tail.wait_beyond(1, 1.0, WORK, 1.0, 2.0) == 1.0  # unstable: every prompt waits


def test_tail_need_is_the_count_that_meets_the_share_interpolated() -> None:
    need = tail.tail_need(RATE, WORK, 2.0, BUDGET, 0.01)
    assert need is not None
    # 2 instances leave 2.9 % of prompts waiting past the budget, 3 leave 0.13 %: the need lies between
    assert tail.wait_beyond(2, RATE, WORK, 2.0, BUDGET) > 0.01 >= tail.wait_beyond(3, RATE, WORK, 2.0, BUDGET)
    assert 2.0 < need < 3.0
    assert math.ceil(need) == 3 and math.ceil(1.5 * RATE * WORK) == 2  # one more than the formula's
    # a heavier tail needs more; a looser share fewer
    assert tail.tail_need(RATE, WORK, 4.0, BUDGET, 0.01) > need > tail.tail_need(RATE, WORK, 2.0, BUDGET, 0.05)


@pytest.mark.parametrize("scv, budget, rate", [
    (None, BUDGET, RATE),  # no histogram
    (1.0, BUDGET, RATE),  # no heavier than exponential: the formula's headroom covers it (MIN_SCV)
    (2.0, 0.0, RATE),  # the mean prompt's own prefill spends the target: no pool size helps
    (2.0, BUDGET, 0.0),  # no load
    (float("nan"), BUDGET, RATE),
    (2.0, BUDGET, 1e9),  # a load no pool has (a bad observation): no search, bounded work
])
def test_tail_need_is_none_where_it_cannot_help(scv, budget, rate) -> None:
    assert tail.tail_need(rate, WORK, scv, budget, 0.01) is None


def test_histogram_scv_from_cumulative_buckets() -> None:
    # every value in (1024, 2048]: uniform there, SCV (1024^2/12) / 1536^2 = 1/27
    assert tail.histogram_scv([(1024.0, 0.0), (2048.0, 10.0), (math.inf, 10.0)]) == pytest.approx(1 / 27)
    # 80 % in [0, 1024], 20 % in (8192, 65536]: a heavy tail (E[x] 7782, E[x^2] 3.27e8)
    assert tail.histogram_scv([(1024.0, 8.0), (8192.0, 8.0), (65536.0, 10.0), (math.inf, 10.0)]) == \
        pytest.approx(4.397, abs=0.001)
    # the +Inf bucket counts at the highest finite bound, as histogram_quantile answers: all of them alike
    assert tail.histogram_scv([(1024.0, 0.0), (math.inf, 4.0)]) == 0.0
    assert tail.histogram_scv([]) is None and tail.histogram_scv([(1024.0, 0.0), (math.inf, 0.0)]) is None


def _decide(pol: asc.Policy, scv: float | None, **kw: float) -> asc.Decision:
    o = obs(RATE, PROMPT, 400, prompt_length_scv=scv, **kw)
    return asc.decide(pol, asc.State(), o, asc.PoolView(2, 2), asc.PoolView(1, 1), 1000.0)


def test_decide_sizes_prefill_for_a_heavy_tail_and_says_so() -> None:
    pol = policy(slo_ttft_seconds=5.0)
    dec = _decide(pol, 2.0)
    assert dec.prefill.recommended == 3 and dec.prefill.desired == 3
    assert dec.inputs["prefillTailNeed"] == pytest.approx(tail.tail_need(RATE, WORK, 2.0, BUDGET, 0.01))
    assert ex.pool_cause(dec, "prefill") == "tail"
    # the same window without a tail, without a TTFT target, or with the rule off: the formula's 2
    for d in (_decide(pol, 0.9), _decide(policy(), 2.0), _decide(asc.Policy(**{**vars(pol), "tail_need": False}), 2.0)):
        assert d.prefill.desired == 2 and ex.pool_cause(d, "prefill") != "tail"


def test_a_burst_peak_is_served_within_the_target_too() -> None:
    # a 10 s peak of 2 req/s: the tail need at the rate the pool must serve within b + TTFT (2 x 10/15)
    pol = policy(slo_ttft_seconds=5.0, burst_window_seconds=10.0)
    dec = _decide(pol, 2.0, peak_request_rate=2.0)
    assert dec.inputs["prefillTailNeed"] == pytest.approx(tail.tail_need(2.0 * 10 / 15, WORK, 2.0, BUDGET, 0.01))
    assert dec.prefill.desired >= math.ceil(dec.inputs["prefillTailNeed"])


def test_the_short_window_confirms_a_tail_scale_up_with_the_tail_of_its_own_rate() -> None:
    # the flip window's short need (no headroom) asks for the same 0.75 instances: with the tail at that rate it
    # asks for 3, so the scale-up is not held as ScaleUpUnconfirmed
    pol = policy(slo_ttft_seconds=5.0)
    o = obs(RATE, PROMPT, 400, prompt_length_scv=2.0)
    dec = asc.decide(pol, asc.State(), o, asc.PoolView(2, 2), asc.PoolView(1, 1), 1000.0,
                     short_need={"prefill": RATE * WORK, "decode": 0.1})
    assert dec.prefill.desired == 3 and dec.prefill.reason == asc.SCALE_UP
    # a short window that asks for little (the load has left) still holds it
    dec = asc.decide(pol, asc.State(), o, asc.PoolView(2, 2), asc.PoolView(1, 1), 1000.0,
                     short_need={"prefill": 0.1, "decode": 0.1})
    assert dec.prefill.desired == 2 and dec.prefill.reason == asc.UNCONFIRMED
