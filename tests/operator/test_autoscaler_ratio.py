"""spec.autoscaling.ratio {min, max} (prefill:decode): validated, kept by every decision, shown in status."""

from __future__ import annotations

import random

import pydantic
import pytest

from pdcluster.operator import autoscaler as asc
from pdcluster.operator import scaling
from pdcluster.operator import status as st
from pdcluster.operator.autoscaler_ratio import (
    RATIO_MAX,
    RATIO_MIN,
    RATIO_UNSATISFIABLE,
    RatioBounds,
    enforce,
)
from pdcluster.operator.models import parse_spec
from pdcluster.operator.planner import Bounds

from .test_autoscaler_guards import obs, policy

BASE = {"model": {"name": "m", "uri": "file:///m"}, "image": "x:1"}


def test_the_short_pool_grows_to_meet_the_bound():
    b = Bounds(1, 32, 1, 32)
    assert enforce(3, 2, RatioBounds(1.0, 2.0), b) == enforce(3, 2, RatioBounds(), b)  # within: untouched
    assert enforce(3, 2, RatioBounds(1.0, 2.0), b).limited_by == ()
    e = enforce(2, 4, RatioBounds(min=1.0), b)  # P/D 0.5 < 1: prefill grows, decode keeps its capacity
    assert (e.prefill, e.decode, e.limited_by) == (4, 4, (RATIO_MIN,))
    e = enforce(9, 2, RatioBounds(max=3.0), b)  # 4.5 > 3: decode grows to ceil(9/3)
    assert (e.prefill, e.decode, e.limited_by) == (9, 3, (RATIO_MAX,))
    e = enforce(7, 2, RatioBounds(max=3.0), b)  # 3.5 > 3: ceil(7/3) = 3
    assert (e.prefill, e.decode) == (7, 3)


def test_where_the_short_pool_cannot_grow_the_other_shrinks_within_its_bounds():
    # prefill capped at 3: P/D >= 1 with D 5 is out of reach, so decode shrinks to 3
    e = enforce(3, 5, RatioBounds(min=1.0), Bounds(1, 3, 1, 32))
    assert (e.prefill, e.decode, e.limited_by) == (3, 3, (RATIO_MIN,))
    # a total budget of 8: 2:6 would need 6:6; the largest split within 8 with P/D >= 1 is 4:4
    e = enforce(2, 6, RatioBounds(min=1.0), Bounds(1, 32, 1, 32, max_total=8))
    assert (e.prefill, e.decode) == (4, 4) and e.prefill + e.decode <= 8
    # decode cannot go below its minimum of 4 and prefill cannot exceed 2: no size meets P/D >= 1
    e = enforce(2, 4, RatioBounds(min=1.0), Bounds(1, 2, 4, 32))
    assert (e.prefill, e.decode, e.limited_by) == (2, 4, (RATIO_UNSATISFIABLE,)) and not e.moved


def test_every_decision_keeps_the_bound():
    # random observations (rates, lengths, ready counts, SLO breaches) over many steps: after each decision
    # P/D lies within [min, max] and each pool within its replica bounds
    rng = random.Random(5)
    bounds = Bounds(1, 20, 1, 20)
    for lo, hi in ((0.5, 2.0), (1.0, 1.0), (2.0, 4.0), (None, 1.5), (3.0, None)):
        pol = policy(bounds=bounds, ratio=RatioBounds(lo, hi), slo_ttft_seconds=5.0)
        state, p, d = asc.State(), 1, 1
        for k in range(200):
            o = obs(rng.uniform(0, 30), i=rng.uniform(100, 8000), o=rng.uniform(10, 800),
                    ttft_seconds=rng.choice([None, 1.0, 20.0]), prefill_queue_mean=rng.uniform(0, 20))
            ready = (rng.randint(0, p), rng.randint(0, d)) if rng.random() < 0.2 else (p, d)
            dec = asc.decide(pol, state, o if rng.random() > 0.05 else None, asc.PoolView(p, ready[0]),
                             asc.PoolView(d, ready[1]), 30.0 * k)
            state, p, d = dec.state, dec.prefill.desired, dec.decode.desired
            assert RatioBounds(lo, hi).holds(p, d), (lo, hi, k, p, d, dec.reason)
            assert 1 <= p <= 20 and 1 <= d <= 20


def test_a_decision_moved_by_the_bound_says_so():
    # the formula wants 3 prefill and 1 decode; the ratio allows at most 2 prefill per decode
    pol = policy(ratio=RatioBounds(max=2.0))
    dec = asc.decide(pol, asc.State(), obs(10, i=2000, o=50), asc.PoolView(1, 1), asc.PoolView(1, 1), 0.0)
    assert (dec.prefill.desired, dec.decode.desired) == (3, 2)
    assert dec.reason == asc.RATIO_BOUND and dec.decode.reason == asc.RATIO_BOUND and RATIO_MAX in dec.limited_by
    assert dec.state.decode.last_change == 0.0  # the moved pool's next window is warm-up
    rec = st.decision_record(dec, "2026-01-01T00:00:00Z")
    assert rec["ratio"] == {"min": None, "max": 2.0, "prefillPerDecode": 1.5, "held": True, "satisfiable": True}
    cond = scaling.scaling_condition(dec)
    assert cond["status"] == "True" and cond["reason"] == "RatioBound"


def test_the_spec_declares_and_validates_the_bound():
    spec = parse_spec({**BASE, "autoscaling": {"ratio": {"min": 0.5, "max": 3}}})
    assert asc.Policy.from_spec(spec).ratio == RatioBounds(0.5, 3.0)
    assert asc.Policy.from_spec(parse_spec(BASE)).ratio == RatioBounds()
    for bad, needle in (({"min": 3, "max": 1}, "min must be <= "), ({"min": 0}, "greater than 0"),
                        ({"max": -1}, "greater than 0")):
        with pytest.raises(pydantic.ValidationError, match=needle):
            parse_spec({**BASE, "autoscaling": {"ratio": bad}})
    with pytest.raises(ValueError):
        RatioBounds(2.0, 1.0)
    with pytest.raises(ValueError):
        RatioBounds(float("nan"))
    # no bound declared: status carries no ratio block
    dec = asc.decide(policy(), asc.State(), obs(10), asc.PoolView(1, 1), asc.PoolView(1, 1), 0.0)
    assert "ratio" not in st.decision_record(dec, "2026-01-01T00:00:00Z")
