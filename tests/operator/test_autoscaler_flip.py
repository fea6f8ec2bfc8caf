"""Role flips as a scaling action: a short pool takes the other pool's slack before starting pods."""

from __future__ import annotations

from pdcluster.operator import autoscaler as asc
from pdcluster.operator import autoscaler_flip as flip
from pdcluster.operator.autoscaler_ratio import RatioBounds
from pdcluster.operator.planner import Bounds

from .test_autoscaler_guards import obs, policy


def test_a_short_pool_flips_the_others_slack_and_starts_pods_for_the_rest():
    # decode-heavy now (4 req/s x 900 output / 2000 x h): decode wants 4 from 2; prefill, held at 5 by
    # the scale-down stabilization, needs 1 (4 x 400 / 10000): slack 4
    pol = policy(max_up_step=100)
    dec = asc.decide(pol, asc.State(), obs(4, i=400, o=900), asc.PoolView(5, 5), asc.PoolView(2, 2), 0.0)
    assert dec.decode.desired > 2 and dec.prefill.desired == 5 and dec.prefill.recommended == 1
    fp = flip.plan(dec, pol)
    grow = dec.decode.desired - 2
    assert fp.to_decode == min(grow, 5 - 1) and fp.to_prefill == 0
    assert fp.decode == dec.decode.desired  # flipped + started = the decision's decode
    assert fp.prefill == 5 - fp.to_decode  # the flipped workers leave prefill


def test_no_slack_no_flip_and_never_below_the_recommendation_or_minimum():
    pol = policy(max_up_step=100, bounds=Bounds(3, 32, 1, 32))
    # prefill recommended 1 but minReplicas 3: slack is 5 - 3 = 2 at most
    dec = asc.decide(pol, asc.State(), obs(8, i=400, o=900), asc.PoolView(5, 5), asc.PoolView(1, 1), 0.0)
    fp = flip.plan(dec, pol)
    assert fp.to_decode == 2 and fp.prefill == 3
    # both pools growing: nothing to take
    dec = asc.decide(pol, asc.State(), obs(40), asc.PoolView(3, 3), asc.PoolView(1, 1), 0.0)
    assert flip.plan(dec, pol) == flip.FlipPlan(dec.prefill.desired, dec.decode.desired)
    # no recommendation (metrics missing): no slack
    dec = asc.decide(pol, asc.State(), None, asc.PoolView(5, 5), asc.PoolView(1, 1), 0.0)
    assert flip.plan(dec, pol).flips == 0


def test_flips_keep_the_declared_ratio():
    # at most 2 prefill per decode... and at least 1: flipping 4 prefill into decode (5:2 -> 1:6) breaks min 1
    pol = policy(max_up_step=100, ratio=RatioBounds(1.0, 3.0))
    dec = asc.decide(pol, asc.State(), obs(4, i=400, o=900), asc.PoolView(5, 5), asc.PoolView(2, 2), 0.0)
    fp = flip.plan(dec, pol)
    assert fp.to_decode > 0 and RatioBounds(1.0, 3.0).holds(fp.prefill, fp.decode)
