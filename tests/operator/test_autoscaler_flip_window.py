"""Role flips on short-window evidence (`autoscaler_flip_window`): flips only, on a trusted and fresh window,
within every bound `decide` keeps, and never back on the next tick."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdcluster.operator import autoscaler as asc
from pdcluster.operator import autoscaler_explain as explain
from pdcluster.operator import autoscaler_flip as flip
from pdcluster.operator import autoscaler_flip_window as fw
from pdcluster.operator import scaling
from pdcluster.operator import status as st
from pdcluster.operator.autoscaler_ratio import RatioBounds
from pdcluster.operator.models import parse_spec
from pdcluster.operator.planner import Bounds

from .conftest import make_spec
from .test_autoscaler_guards import obs, policy

W = 20.0  # the flip window
REC = {"prefill": 3, "decode": 1}  # what the last (long-window) decision recommended: the old, prompt-heavy mix


def turned(rate: float = 4.0) -> asc.Observation:
    """The last 20 s after the mix turned: short prompts, long outputs (4 req/s x 900 / 2000: 1.8 decode)."""
    return obs(rate, i=400, o=900)


def flips(pol=None, o=None, p=(3, 3), d=(1, 1), state=None, now=1000.0, rec=REC):
    return fw.window_flips(pol or policy(), state or asc.State(), o if o is not None else turned(),
                           asc.PoolView(*p), asc.PoolView(*d), now, window_seconds=W, recommended=rec)


def test_a_turn_of_the_mix_flips_workers_toward_the_windows_split_and_starts_no_pod():
    d = flips()
    assert d is not None and d.reason == flip.FLIP_WINDOW
    # decode: ceil(1.8) = 2 from 1; prefill keeps ceil(4 x 400 / 10000 x 1.1) = 1 of 3: one flip to decode
    assert (d.prefill.current, d.prefill.desired, d.decode.current, d.decode.desired) == (3, 2, 1, 2)
    assert d.prefill.desired + d.decode.desired == 3 + 1  # the total is unchanged: flips only
    assert explain.causes(d) == {"prefill": "flip", "decode": "flip"}
    assert "RoleFlipShortWindow" in explain.message(d)
    assert d.inputs["decodeWindowNeed"] == 4 * 900 / 2000 and d.inputs["windowRequests"] == 80
    # both pools changed now: the next window must begin after the flip is ready
    assert d.state.prefill.last_change == d.state.decode.last_change == 1000.0
    # the other way round: prefill-heavy evidence with decode holding slack (a primed start)
    d = flips(o=obs(4, i=6000, o=20), p=(1, 1), d=(3, 3), rec={"prefill": 1, "decode": 3})
    assert d is not None and (d.prefill.desired, d.decode.desired) == (3, 1)


def test_too_few_requests_or_unknown_lengths_are_no_evidence():
    # 1.4 and 1.5 req/s of 2000-token outputs: a decode need of 1.4 / 1.5, but 28 requests in 20 s < 30
    assert flips(o=obs(1.4, i=400, o=2000)) is None
    assert flips(o=obs(1.5, i=400, o=2000)) is not None
    assert flips(o=asc.Observation(4.0, None, 900.0)) is None
    assert fw.short_needs(policy(prefill_capacity=None), asc.State(), turned(), W) is None  # C_p unknown


def test_nothing_in_flight_and_the_window_must_postdate_the_last_change():
    assert flips(p=(3, 2)) is None  # a pod (or an earlier flip) still on its way
    changed = asc.State(decode=asc.PoolState(last_change=990.0, ready_at=995.0))
    assert flips(state=changed) is None  # the window began before the change was ready
    assert flips(state=changed, now=995.0 + W) is not None
    # right after its own flip, the same evidence flips nothing more (hysteresis: a whole fresh window)
    d = flips()
    assert d is not None
    assert flips(p=(2, 2), d=(2, 2), state=d.state, now=1005.0) is None


def test_the_giving_pool_keeps_its_need_with_margin_its_minimum_and_needs_a_recommendation():
    # prefill's window need 4 x 2250 / 10000 = 0.9; with the 10 % margin 0.99 -> keeps 1; at 2500: 1.1 -> 2
    assert flips(o=obs(4, i=2250, o=900), p=(2, 2)) is not None
    assert flips(o=obs(4, i=2500, o=900), p=(2, 2)) is None
    assert flips(pol=policy(bounds=Bounds(3, 32, 1, 32))) is None  # prefill's minReplicas is 3
    assert flips(rec={"prefill": None, "decode": 1}) is None  # no recommendation: metrics or capacity unknown
    # the long-window recommendation does not protect the giving pool: it is the stale belief
    assert flips(rec={"prefill": 3, "decode": 1}) is not None


def test_flips_stay_within_max_replicas_the_step_and_the_ratio():
    big = obs(8, i=400, o=900)  # decode 3.6 -> 4 from 1; prefill keeps 1 of 5
    d = flips(o=big, p=(5, 5))
    assert d is not None and (d.prefill.desired, d.decode.desired) == (2, 4)
    d = flips(o=big, p=(5, 5), pol=policy(bounds=Bounds(1, 32, 1, 2)))
    assert d is not None and d.decode.desired == 2  # decode's maxReplicas
    d = flips(o=big, p=(5, 5), pol=policy(max_up_step=1))
    assert d is not None and d.decode.desired == 2
    # P/D at least 1: from 5:1, 3:3 holds and 2:4 does not
    d = flips(o=big, p=(5, 5), pol=policy(ratio=RatioBounds(1.0, None)))
    assert d is not None and (d.prefill.desired, d.decode.desired) == (3, 3)
    assert flips(o=big, p=(1, 1), d=(1, 1), pol=policy(ratio=RatioBounds(1.0, None))) is None


def test_decides_flips_keep_what_a_trusted_short_window_asks_for():
    # the long window still reads the old mix and grows prefill; decode is above its long-window
    # recommendation, but the short window needs 2 decode: no flip takes it below that, pods start instead
    pol = policy()
    dec = asc.decide(pol, asc.State(), obs(4, i=6000, o=20), asc.PoolView(2, 2), asc.PoolView(2, 2), 0.0)
    assert dec.prefill.desired > 2 and dec.decode.recommended == 1
    assert flip.plan(dec, pol).to_prefill == 1
    sn = fw.short_needs(pol, dec.state, turned(), W)
    assert sn is not None and sn.keep["decode"] == 2
    fp = flip.plan(dec, pol, sn.keep)
    assert fp.to_prefill == 0 and fp.decode == 2 and fp.prefill == dec.prefill.desired


def test_the_need_is_the_windows_mean_demand_and_its_backlog_without_headroom():
    sn = fw.short_needs(policy(headroom=1.5), asc.State(), obs(4, i=400, o=900, decode_queue_now=10.0), W)
    assert sn is not None
    # 1.8 decode instances of arrivals, and 10 queued requests worked off within the 20 s window: 2.025
    assert sn.need["decode"] == pytest.approx(4 * 900 / 2000 + 10 * (900 / 2000) / W)
    assert sn.need["prefill"] == pytest.approx(4 * 400 / 10000) and sn.short == {"prefill": 1, "decode": 3}


def test_the_last_decision_in_status_gives_the_recommendations():
    dec = asc.decide(policy(), asc.State(), obs(4, i=6000, o=20), asc.PoolView(3, 3), asc.PoolView(1, 1), 0.0)
    status = st.autoscaler_status(dec, st.fmt_time(0.0))
    assert fw.last_recommended(status) == {"prefill": dec.prefill.recommended, "decode": dec.decode.recommended}
    assert fw.last_recommended({}) == {}
    assert fw.last_recommended({"lastDecision": {"prefill": {"recommended": True}, "decode": {"recommended": -1}}}) \
        == {"prefill": None, "decode": None}
    assert fw.period(20) == 5 and fw.period(60) == 15 and fw.period(4) == 5


# ---- the operator's step (scaling.py): between decisions and on a decision's tick ---------------------

class WindowSource:
    """A metrics source answering per window: the decisions' (120 s) and the flip window's (20 s)."""

    def __init__(self, long: asc.Observation, short: asc.Observation) -> None:
        self.long, self.short, self.windows = long, short, []

    def observe(self, cluster, window_seconds, ready=None, **_):  # noqa: ANN001, ANN003, ANN201
        self.windows.append(window_seconds)
        return self.short if window_seconds == 20 else self.long


async def test_between_decisions_the_operator_flips_on_the_short_window_and_keeps_decides_clock() -> None:
    from .test_scaling import NOW, auto_spec, pools

    spec = auto_spec(intervalSeconds=30)  # flipWindowSeconds: 20 by default
    assert spec.autoscaling.flipWindowSeconds == 20
    prompt_heavy = asc.Observation(3.0, 6000.0, 20.0)  # 1.5 x 3 x 6000 / 10000 = 2.7 prefill, 1 decode
    first = await scaling.step(spec, {}, pools(3, 1), NOW - 40, cluster="demo",
                               source_for=lambda u: WindowSource(prompt_heavy, prompt_heavy), resync_seconds=60)
    assert first.decision is not None and not first.decision.changed
    old = {"prefill": {"desiredReplicas": 3}, "decode": {"desiredReplicas": 1}, "autoscaler": first.autoscaler_status}
    # 10 s after that decision (not due): the last 20 s turned to long outputs -> one prefill worker flips
    source = WindowSource(prompt_heavy, turned())
    s = await scaling.step(spec, old, pools(3, 1), NOW - 30, cluster="demo", source_for=lambda u: source,
                           resync_seconds=60)
    assert source.windows == [20]  # only the short window was read
    assert s.decision is not None and s.decision.reason == flip.FLIP_WINDOW
    assert s.desired == {"prefill": 2, "decode": 2} and s.before_flips == {"prefill": 3, "decode": 1}
    assert s.scaled_message and s.scaled_message.startswith("prefill 3->2 (flip), decode 1->2 (flip)")
    assert "last 20 s" in s.scaled_message
    assert s.autoscaler_status["lastEvaluationTime"] == first.autoscaler_status["lastEvaluationTime"]
    assert s.autoscaler_status["lastDecision"]["reason"] == "RoleFlipShortWindow"
    assert s.next_delay == 5  # the step's own period (a quarter window)
    # the next pass, 5 s later with the flip in flight (decode 1 of 2 ready): nothing, and no flip back
    old2 = {"prefill": {"desiredReplicas": 2}, "decode": {"desiredReplicas": 2}, "autoscaler": s.autoscaler_status}
    s2 = await scaling.step(spec, old2, pools(2, 2, ready=(2, 1)), NOW - 25, cluster="demo",
                            source_for=lambda u: WindowSource(prompt_heavy, prompt_heavy), resync_seconds=60)
    assert s2.decision is None and s2.desired == {"prefill": 2, "decode": 2}


async def test_pools_that_cannot_flip_or_a_zero_window_read_no_short_window() -> None:
    from .test_scaling import NOW, auto_spec, pools

    for spec in (auto_spec(flipWindowSeconds=0), parse_spec(make_spec(
            roleFlips=False, autoscaling={"enabled": True, "prometheusUrl": "http://prom:9090"}))):
        source = WindowSource(asc.Observation(4.0, 6000.0, 20.0), turned())
        old = {"autoscaler": {"lastEvaluationTime": st.fmt_time(NOW - 10)}}
        s = await scaling.step(spec, old, pools(3, 1), NOW, cluster="demo", source_for=lambda u, s=source: s,
                               resync_seconds=60)
        assert source.windows == [] and s.decision is None


async def test_on_a_decisions_tick_that_changes_nothing_the_flip_step_runs_too() -> None:
    from .test_scaling import NOW, auto_spec, pools

    spec = auto_spec(intervalSeconds=30)
    prompt_heavy = asc.Observation(3.0, 6000.0, 20.0)
    first = await scaling.step(spec, {}, pools(3, 1), NOW - 40, cluster="demo",
                               source_for=lambda u: WindowSource(prompt_heavy, prompt_heavy), resync_seconds=60)
    old = {"prefill": {"desiredReplicas": 3}, "decode": {"desiredReplicas": 1}, "autoscaler": first.autoscaler_status}
    source = WindowSource(prompt_heavy, turned())
    s = await scaling.step(spec, old, pools(3, 1), NOW, cluster="demo", source_for=lambda u: source,
                           resync_seconds=60)
    assert sorted(source.windows) == [20, 120]  # the decision's window and the flip window
    assert s.decision is not None and s.decision.reason == flip.FLIP_WINDOW
    assert s.desired == {"prefill": 2, "decode": 2}
    assert s.autoscaler_status["lastEvaluationTime"] == st.fmt_time(NOW)  # the decision was made: due again in 30 s
    assert {c["type"] for c in s.conditions} >= {"MetricsAvailable", "ScalingLimited", "SLOMet"}
    assert s.next_delay == 5


def test_o_is_read_by_completion_where_requests_finished_in_the_window():
    """20 s after a turn toward long answers, tokens generated per request admitted still reads 265 (the answers
    have barely begun); the requests that finished in the window averaged 900: that is the window's O."""
    lagging = obs(4.0, i=400, o=265)
    assert flips(o=lagging) is None  # 4 x 265 / 2000 = 0.53 decode: no flip on O by admission
    d = flips(o=replace(lagging, finished_output_tokens=900.0))
    assert d is not None and (d.prefill.desired, d.decode.desired) == (2, 2)
    assert d.inputs["decodeWindowNeed"] == pytest.approx(4 * 900 / 2000)
    assert d.inputs["meanOutputTokens"] == 265 and d.inputs["finishedOutputTokens"] == 900
    assert "by completion 900" in explain.window_inputs(d)
    # the other way: O by admission overshoots while a backlog drains; the finished requests' 900 holds
    assert fw.short_needs(policy(), asc.State(), replace(obs(4.0, i=400, o=1400), finished_output_tokens=900.0),
                          W).need["decode"] == pytest.approx(4 * 900 / 2000)


def test_a_formula_scale_up_the_short_window_does_not_ask_for_is_held():
    """At the turn of shift seed 5 the 120 s window still averages the old prompts (I = 3,158) and asks for
    more prefill instances; the last 20 s (I = 405) need 0.24 of one: no pod is ordered for a load that left."""
    pol = policy(prefill_capacity=10_000.0, decode_capacity=2_000.0, bounds=Bounds(1, 8, 1, 8))
    long_window = obs(6.37, i=3158, o=360)
    views = (asc.PoolView(2, 2, 0.0), asc.PoolView(4, 4, 0.0))
    grow = asc.decide(pol, asc.State(), long_window, *views, 960.0)
    assert grow.prefill.desired == 4 and grow.prefill.reason == asc.SCALE_UP  # ceil(1.5 x 6.37 x 0.3158)
    short = fw.need(pol, asc.State(), replace(obs(5.95, i=405, o=1009), finished_output_tokens=905.0), W)
    assert short is not None and short["prefill"] == pytest.approx(5.95 * 405 / 10_000)
    held = asc.decide(pol, asc.State(), long_window, *views, 960.0, short)
    assert (held.prefill.desired, held.prefill.reason, held.reason) == (2, asc.UNCONFIRMED, asc.UNCONFIRMED)
    assert held.state.prefill.last_change is None  # nothing changed: the pool's clocks run on
    assert held.inputs["prefillShortNeed"] == pytest.approx(1.5 * 5.95 * 405 / 10_000)
    assert explain.causes(held)["prefill"] == "stabilization"
    # a short window that asks for the growth too (its need with headroom above the pool) confirms it
    assert asc.decide(pol, asc.State(), long_window, *views, 960.0, {"prefill": 1.5, "decode": 1.0}).prefill.desired == 4
    # the SLO guard's growth answers a breach with a queue: never held
    breach = replace(obs(6.37, i=300, o=360), ttft_seconds=20.0, prefill_queue_mean=30.0, prefill_queue_now=40.0)
    pol_slo = replace(pol, slo_ttft_seconds=5.0)
    d = asc.decide(pol_slo, asc.State(), breach, *views, 960.0, {"prefill": 0.1, "decode": 1.0})
    assert d.prefill.reason == asc.SLO_GUARD and d.prefill.desired > 2
