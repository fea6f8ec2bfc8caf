"""The adaptive headroom counts only the part of a window's peak rate that a steady Poisson rate would not
show by chance (`autoscaler_rules.counting_noise`)."""

from __future__ import annotations

import math

import pytest

from pdcluster.operator import autoscaler as asc
from pdcluster.operator import autoscaler_rules as rules
from pdcluster.operator.planner import Bounds


def policy(**kw) -> asc.Policy:
    base = dict(window_seconds=120.0, headroom=1.5, bounds=Bounds(1, 32, 1, 32), stabilization_seconds=300,
                max_up_step=4, max_down_step=1, rollout_timeout_seconds=600, prefill_capacity=10000.0,
                decode_capacity=2000.0, burst_window_seconds=10.0, slo_ttft_seconds=5.0)
    base.update(kw)
    return asc.Policy(**base)


def test_counting_noise_is_two_sigmas_of_a_poisson_count() -> None:
    # 4 req/s over 10 s: 40 ± √40 arrivals, so 4 ± 0.63 req/s; two σ: 1.26 req/s
    assert rules.counting_noise(4.0, 10.0) == pytest.approx(2 * math.sqrt(0.4))
    # relative noise shrinks with the rate: 6 % of 100 req/s, 32 % of 4 req/s
    assert rules.counting_noise(100.0, 10.0) / 100.0 == pytest.approx(0.0632, abs=1e-3)
    # unknown burst window, or no traffic: no correction
    assert rules.counting_noise(4.0, None) == 0.0 and rules.counting_noise(4.0, 0.0) == 0.0
    assert rules.counting_noise(0.0, 10.0) == 0.0


def test_a_chance_peak_adds_no_headroom_a_burst_still_does() -> None:
    # a steady 4.25 req/s whose highest 10 s rate was 6.1 (the `shift` trace's first half): by chance
    noisy = rules.effective_headroom(1.5, 4.25, 6.1, 2.0, 10.0)
    floor_ = 4.25 + 2 * math.sqrt(0.425)
    assert noisy == pytest.approx(1 + 0.5 * (6.1 - floor_) / (8.5 - floor_), abs=1e-9)
    assert noisy < 1.1 < rules.effective_headroom(1.5, 4.25, 6.1, 2.0)  # 1.22 without the burst window
    # a peak within the noise: no headroom at all
    assert rules.effective_headroom(1.5, 4.0, 5.2, 2.0, 10.0) == 1.0
    # a burst (a peak of bursty_ratio x the mean) still gets the whole ceiling; a high rate is hardly corrected
    assert rules.effective_headroom(1.5, 4.0, 8.0, 2.0, 10.0) == 1.5
    assert rules.effective_headroom(1.5, 100.0, 150.0, 2.0, 10.0) == pytest.approx(1.0 + 0.5 * 43.68 / 93.68,
                                                                                    abs=1e-3)
    # so low a rate that chance reaches twice the mean (0.3 req/s: 3 ± 1.7 arrivals in 10 s): only a peak
    # past chance counts, and then as a burst
    assert rules.effective_headroom(1.5, 0.3, 0.6, 2.0, 10.0) == 1.0
    assert rules.effective_headroom(1.5, 0.3, 1.0, 2.0, 10.0) == 1.5


def test_a_steady_load_is_not_given_an_instance_for_its_noise() -> None:
    # 4.25 req/s of 5967-token prompts at 10k tok/s: 2.54 instances of work. The peak 6.1 read as variability
    # asked for 1.22 x 2.54 = 3.09 -> 4 prefill instances; a 3:2 pool served this load at 100 %.
    o = asc.Observation(4.25, 5967.0, 22.0, peak_request_rate=6.1)
    views = (asc.PoolView(3, 3), asc.PoolView(1, 1))
    dec = asc.decide(policy(), asc.State(), o, *views, now=0.0)
    assert dec.prefill.desired == 3 and dec.inputs["headroom"] < 1.1
    without = asc.decide(policy(burst_window_seconds=None), asc.State(), o, *views, now=0.0)
    assert without.prefill.desired == 4
