"""The autoscaler's decode need counts t_join, the observed per-request admission cost of the decode pool
(`pdcluster_decode_join_seconds`), with a configured C_d only; missing or bad -> the formula without it."""

from __future__ import annotations

import math

import pytest

from pdcluster.operator import autoscaler as asc
from pdcluster.operator import autoscaler_rules as rules
from pdcluster.operator.planner import Bounds, plan

CP, CD = 481.0, 211.0  # the last ratio sweep's profiled capacities (docs/benchmarks/ratio_sweep.md at 5f904a5)


def policy(**kw) -> asc.Policy:
    base = dict(headroom=1.0, adaptive_headroom=False, bounds=Bounds(1, 32, 1, 32), prefill_capacity=CP,
                decode_capacity=CD)
    base.update(kw)
    return asc.Policy(**base)


def decide(pol: asc.Policy, o: asc.Observation, cur: tuple[int, int] = (1, 1)) -> asc.Decision:
    return asc.decide(pol, asc.State(), o, asc.PoolView(cur[0], cur[0]), asc.PoolView(cur[1], cur[1]), 0.0)


def observation(rate: float, join: float | None, **kw) -> asc.Observation:
    return asc.Observation(rate, 302.0, 2.8, decode_join_seconds=join, **kw)


def test_the_join_time_grows_the_decode_pool() -> None:
    # 30 req/s of 2.8 output tokens: 0.4 decode instances from O/C_d; with 50 ms to admit each, 1.9 -> 2
    without = decide(policy(), observation(30.0, None))
    with_join = decide(policy(), observation(30.0, 0.05))
    assert without.decode.recommended == 1 and with_join.decode.recommended == 2
    assert with_join.prefill.recommended == without.prefill.recommended  # prefill untouched
    assert with_join.inputs["decodeJoinSeconds"] == 0.05 and without.inputs["decodeJoinSeconds"] == 0.0
    # the same need the planner computes with the same inputs
    p = plan(input_len=302, output_len=2.8, prefill_capacity=CP, decode_capacity=CD, request_rate=30.0,
             headroom=1.0, decode_join_seconds=0.05)
    assert with_join.decode.recommended == p.decode_replicas


@pytest.mark.parametrize("bad", [None, math.nan, -0.2, math.inf])
def test_a_missing_or_bad_join_series_is_the_formula_without_it(bad: float | None) -> None:
    d = decide(policy(), observation(30.0, bad))
    assert d.metrics_available and d.decode.recommended == 1 and d.inputs["decodeJoinSeconds"] == 0.0


def test_a_learned_decode_capacity_already_includes_the_joins() -> None:
    # C_d learned from saturated windows is output tok/s with the joins' time in it: not counted twice
    assert rules.join_seconds(0.05, "learned") == 0.0 and rules.join_seconds(0.05, "spec") == 0.05
    st = asc.State(decode=asc.PoolState(learned_capacity=CD))
    pol = policy(decode_capacity=None)
    d = asc.decide(pol, st, observation(30.0, 0.05), asc.PoolView(1, 1), asc.PoolView(1, 1), 0.0)
    assert d.decode.capacity_source == "learned" and d.inputs["decodeJoinSeconds"] == 0.0
    assert d.decode.recommended == 1


def test_join_cost_takes_one_step_off_the_admission_time() -> None:
    # the first output leaves with the step that carries the request, whose tokens O/C_d counts already
    assert rules.join_cost(0.040, 0.010) == pytest.approx(0.030)
    assert rules.join_cost(0.040, None) == 0.040  # no step series: the whole admission time
    assert rules.join_cost(0.008, 0.010) == 0.0  # never negative
    assert rules.join_cost(None, 0.010) is None and rules.join_cost(math.nan, 0.01) is None
    assert rules.join_cost(0.040, math.nan) == 0.040


def test_a_configured_join_time_is_the_one_plan_uses() -> None:
    """`pdcluster profile --stream-rate` gives t_join as a cost under arrivals; configured, the autoscaler
    uses it (not the live admission latency), so it sizes decode exactly as `pdcluster plan` does."""
    pol = policy(decode_join_seconds=0.07)
    for live in (None, 0.01, 0.5):
        d = decide(pol, observation(30.0, live))
        assert d.inputs["decodeJoinSeconds"] == 0.07
        p = plan(input_len=302, output_len=2.8, prefill_capacity=CP, decode_capacity=CD, request_rate=30.0,
                 headroom=1.0, decode_join_seconds=0.07)
        assert d.decode.recommended == p.decode_replicas == 3  # 30 x (2.8/211 + 0.07) = 2.5
    # a learned C_d has the joins in it: not counted twice, configured or not
    assert rules.join_seconds(0.05, "learned", 0.07) == 0.0
    assert rules.join_seconds(0.05, "spec", None) == 0.05 and rules.join_seconds(0.05, "spec", math.nan) == 0.05


def test_up_autoscale_passes_the_configured_join_time_to_the_same_core() -> None:
    from pdcluster.cli import build_parser
    from pdcluster.worker.local import launcher

    args = build_parser("up").parse_args(["--autoscale", "--decode-capacity", "211", "--decode-join-seconds", "0.07"])
    pol = launcher.autoscale_policy(args)
    assert pol.decode_join_seconds == 0.07 and pol.decode_capacity == 211
    assert launcher.autoscale_policy(build_parser("up").parse_args([])).decode_join_seconds is None
