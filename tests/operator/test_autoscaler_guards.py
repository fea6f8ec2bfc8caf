"""The rules real traffic asked for: a sliding scale-down window, the SLO guard, cold-start samples,
prefix-cache hits and bursts (peak λ). Each drives the pure core (`autoscaler.decide`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdcluster.operator import autoscaler as asc
from pdcluster.operator import autoscaler_rules as rules
from pdcluster.operator import status as st
from pdcluster.operator.models import parse_spec
from pdcluster.operator.planner import Bounds

CP, CD = 10000.0, 2000.0


def policy(**kw) -> asc.Policy:
    base = dict(window_seconds=120.0, headroom=1.5, bounds=Bounds(1, 32, 1, 32), stabilization_seconds=300, max_up_step=100,
                max_down_step=1, rollout_timeout_seconds=600, prefill_capacity=CP, decode_capacity=CD)
    base.update(kw)
    return asc.Policy(**base)


def obs(rate: float, i: float = 2000, o: float = 400, **kw) -> asc.Observation:
    return asc.Observation(rate, i if rate else None, o if rate else None, **kw)


def run(pol, state, observations, p, d, t0=0.0, dt=30.0, since=None):
    """Feed observations every dt seconds, applying each decision; returns the decisions."""
    out = []
    for k, o in enumerate(observations):
        now = t0 + k * dt
        dec = asc.decide(pol, state, o, asc.PoolView(p, p, since), asc.PoolView(d, d, since), now)
        state, p, d = dec.state, dec.prefill.desired, dec.decode.desired
        out.append(dec)
    return out


# ---- 1. the scale-down window slides -------------------------------------------------------------------

def test_after_a_peak_the_pool_returns_to_its_minimum() -> None:
    # 12 req/s needs 1.5*12*2000/10000 = 3.6 -> 4 prefill; then 1 req/s for 30 minutes (needs 0.3 -> 1).
    # The decaying tail of the peak (the 120 s window's mean falls gradually) used to stay the
    # window's max forever, holding the pool one step above the minimum.
    tail = [obs(r) for r in (9, 6, 3)]  # the window's mean while the peak slides out of it
    decs = run(policy(), asc.State(), [obs(12)] * 10 + tail + [obs(1)] * 60, 1, 1)
    assert max(d.prefill.desired for d in decs) == 4
    assert decs[-1].prefill.desired == 1, [d.prefill.desired for d in decs[-20:]]


def test_the_need_window_is_bounded_and_old_samples_expire() -> None:
    w = rules.NeedWindow()
    for t in range(0, 10_000, 5):
        w = w.add(float(t), 7.0 if t in (5_000, 9_700) else 1.0, keep_seconds=600)
        if t == 5_700:
            # the spike at 5000 s expired (no merge may carry an old peak forward), and bounded
            assert w.peak() == 1.0 and len(w.samples) <= rules.MAX_NEED_SAMPLES
    assert len(w.samples) <= rules.MAX_NEED_SAMPLES
    assert w.peak() == 7.0  # the spike at 9700 s is within 600 s of the last sample (9995 s)
    assert min(t for t, _ in w.samples) >= 9995 - 600
    w = w.add(20_000.0, 0.5, keep_seconds=600)
    assert w.samples == [(20_000.0, 0.5)]


def test_the_window_survives_a_restart_through_status() -> None:
    decs = run(policy(), asc.State(), [obs(12)] * 3 + [obs(3)] * 3, 4, 4)
    state = decs[-1].state
    restored = st.autoscaler_state(st.autoscaler_state_status(state))
    flat = [x for pair in state.prefill.recent_needs for x in pair]
    assert [x for pair in restored.prefill.recent_needs for x in pair] == pytest.approx(flat)
    assert len(flat) == 12
    assert restored.prefill.below_since == state.prefill.below_since
    # junk in the status is ignored, not a crash
    junk = {"stabilization": {"prefill": {"recentNeeds": [[1, "x"], "y", [2, -1], [3.0, 2.0]]}},
            "slo": {"prefill": {"capacityScale": 7, "breaches": -2}}}
    s = st.autoscaler_state(junk)
    assert s.prefill.recent_needs == ((3.0, 2.0),) and s.prefill.capacity_scale == 1.0
    assert s.prefill.slo_breaches == 0


# ---- 2. SLO guard --------------------------------------------------------------------------------------

def test_a_broken_ttft_grows_prefill_even_when_the_formula_says_enough() -> None:
    pol = policy(slo_ttft_seconds=2.0, slo_tpot_seconds=0.1)
    # 4 req/s: the formula wants 1.5*4*0.2 = 1.2 -> 2 prefill, 1.5*4*0.2 = 1.2 -> 2 decode; 3 of each run.
    state = asc.State()
    dec = asc.decide(pol, state, obs(4, ttft_seconds=6.0, tpot_seconds=0.05), asc.PoolView(3, 3),
                     asc.PoolView(3, 3), 1000.0)
    assert dec.prefill.recommended == 2 and dec.prefill.desired == 9  # 3 x 6/2: in proportion to the breach
    assert dec.prefill.reason == asc.SLO_GUARD and dec.reason == asc.SLO_GUARD and dec.prefill.slo_breached
    assert dec.decode.desired == 3 and not dec.decode.slo_breached  # TPOT is fine: decode is not touched
    # the capacity the formula believes in is corrected, and kept in the state
    assert dec.state.prefill.capacity_scale == pytest.approx(rules.SLO_CAPACITY_CUT)
    assert dec.state.prefill.slo_breaches == 1 and dec.state.decode.capacity_scale == 1.0
    # still broken, but the change is younger than a window: no second step, and the corrected capacity
    nxt = asc.decide(pol, dec.state, obs(4, ttft_seconds=3.0), asc.PoolView(9, 9), asc.PoolView(3, 3), 1030.0)
    assert nxt.prefill.capacity == pytest.approx(CP * rules.SLO_CAPACITY_CUT) and nxt.prefill.desired == 9


def test_a_breach_the_load_explains_is_no_capacity_correction() -> None:
    # 12 req/s needs 1.5*12*0.2 = 3.6 -> 4 prefill: the formula already grows the pool
    pol = policy(slo_ttft_seconds=2.0)
    dec = asc.decide(pol, asc.State(), obs(12, ttft_seconds=6.0), asc.PoolView(3, 3), asc.PoolView(3, 3), 1000.0)
    assert dec.prefill.desired == 4 and dec.prefill.reason == asc.SCALE_UP
    assert dec.state.prefill.capacity_scale == 1.0 and dec.state.prefill.slo_breaches == 0


def test_a_broken_tpot_grows_decode() -> None:
    pol = policy(slo_tpot_seconds=0.05)
    dec = asc.decide(pol, asc.State(), obs(4, tpot_seconds=0.2), asc.PoolView(3, 3), asc.PoolView(3, 3), 1000.0)
    assert (dec.prefill.desired, dec.decode.desired) == (3, 12) and dec.decode.reason == asc.SLO_GUARD  # 3 x 4


def test_a_tpot_breach_the_load_valve_explains_grows_no_decode() -> None:
    # the router had decode workers prefill prompts (load-driven aggregation): their batches stood still, so
    # the broken TPOT is the valve's price; the breach is still reported, and the prefill side is what grows
    pol = policy(slo_tpot_seconds=0.05, slo_ttft_seconds=2.0)
    # a decode queue of 1 adds 0.25 s (1 / 4 req/s): a wait against TPOT's 0.05 s, none worth a pod against TTFT's 2 s
    o = obs(4, tpot_seconds=0.2, ttft_seconds=6.0, prefill_queue_mean=20.0, prefill_queue_now=20.0,
            decode_queue_mean=1.0, decode_queue_now=1.0)
    grown = asc.decide(pol, asc.State(), o, asc.PoolView(3, 3), asc.PoolView(3, 3), 1000.0)
    assert grown.decode.reason == asc.SLO_GUARD and grown.decode.desired > 3  # without the valve: decode's breach
    dec = asc.decide(pol, asc.State(), replace(o, load_aggregated_rate=0.3), asc.PoolView(3, 3), asc.PoolView(3, 3),
                     1000.0)
    assert dec.decode.desired == 3 and dec.decode.slo_breached and dec.state.decode.slo_breaches == 0
    assert dec.prefill.reason == asc.SLO_GUARD and dec.prefill.desired > 3
    # a TPOT that holds while the valve works changes nothing either
    o = obs(4, tpot_seconds=0.04, load_aggregated_rate=0.3)
    assert asc.decide(pol, asc.State(), o, asc.PoolView(3, 3), asc.PoolView(3, 3), 1000.0).decode.desired == 3


def test_the_guard_acts_once_per_window_and_not_during_a_rollout() -> None:
    pol = policy(slo_ttft_seconds=2.0, window_seconds=120)
    o = obs(4, ttft_seconds=2.5)  # 1.25x the target: one replica a step (ceil(3 x 1.25) = 4)
    dec = asc.decide(pol, asc.State(), o, asc.PoolView(3, 3), asc.PoolView(3, 3), 1000.0)
    assert dec.prefill.desired == 4
    # the new pod is not ready: RolloutInProgress, no second step for the same breach
    dec = asc.decide(pol, dec.state, o, asc.PoolView(4, 3), asc.PoolView(3, 3), 1030.0)
    assert dec.prefill.desired == 4 and dec.prefill.reason == asc.ROLLOUT
    # ready, but the window still holds latencies from before the change: no news
    dec = asc.decide(pol, dec.state, o, asc.PoolView(4, 4), asc.PoolView(3, 3), 1090.0)
    assert dec.prefill.desired == 4 and dec.state.prefill.slo_breaches == 1
    # a window after the order but not after the pod was seen ready (1090 s): its window still mixes sizes
    dec = asc.decide(pol, dec.state, o, asc.PoolView(4, 4), asc.PoolView(3, 3), 1130.0)
    assert dec.prefill.desired == 4 and dec.state.prefill.slo_breaches == 1
    # a whole window after the change was ready and still broken: one more
    dec = asc.decide(pol, dec.state, o, asc.PoolView(4, 4), asc.PoolView(3, 3), 1210.0)
    assert dec.prefill.desired == 5 and dec.state.prefill.slo_breaches == 2


def test_the_guard_respects_max_replicas_and_a_met_slo_recovers_the_capacity() -> None:
    pol = policy(slo_ttft_seconds=2.0, bounds=Bounds(1, 3, 1, 32))
    dec = asc.decide(pol, asc.State(), obs(4, ttft_seconds=6.0), asc.PoolView(3, 3), asc.PoolView(3, 3), 1000.0)
    assert dec.prefill.desired == 3 and dec.prefill.slo_breached  # reported, but no room to grow
    scale = 0.7
    state = asc.State(prefill=asc.PoolState(capacity_scale=scale))
    dec = asc.decide(pol, state, obs(4, ttft_seconds=0.3), asc.PoolView(3, 3), asc.PoolView(3, 3), 1030.0)
    assert dec.state.prefill.capacity_scale == pytest.approx(scale + rules.CAPACITY_RECOVERY)
    assert st.autoscaler_state(st.autoscaler_state_status(dec.state)).prefill.capacity_scale == pytest.approx(
        dec.state.prefill.capacity_scale)


def test_no_slo_configured_no_guard() -> None:
    dec = asc.decide(policy(), asc.State(), obs(4, ttft_seconds=60.0, tpot_seconds=9.0), asc.PoolView(3, 3),
                     asc.PoolView(3, 3), 1000.0)
    assert dec.prefill.desired == 3 and dec.decode.desired == 3 and not dec.prefill.slo_breached


# ---- 3. cold start -------------------------------------------------------------------------------------

WARMUP = obs(8, prefill_tokens_per_instance=1000.0, decode_tokens_per_instance=200.0,
             prefill_saturated=True, decode_saturated=True)  # fresh pods: 10x slower while warming up
STEADY = obs(8, prefill_tokens_per_instance=10000.0, decode_tokens_per_instance=2000.0,
             prefill_saturated=True, decode_saturated=True)


def test_cold_start_samples_teach_nothing_and_do_not_over_scale() -> None:
    pol = policy(prefill_capacity=None, decode_capacity=None, window_seconds=120)
    views = (asc.PoolView(2, 2, since=0.0), asc.PoolView(2, 2, since=0.0))  # created at t=0
    dec = asc.decide(pol, asc.State(), WARMUP, *views, 60.0)
    assert dec.state.prefill.learned_capacity is None and dec.reason == asc.CAPACITY_UNKNOWN
    assert (dec.prefill.desired, dec.decode.desired) == (2, 2)
    dec = asc.decide(pol, dec.state, STEADY, *views, 150.0)
    assert dec.state.prefill.learned_capacity == 10000.0
    # 1.5 * 8 * 2000 / 10000 = 2.4 -> 3 and 1.5 * 8 * 400 / 2000 = 2.4 -> 3: the steady-state answer
    assert (dec.prefill.desired, dec.decode.desired) == (3, 3)


def test_pods_still_starting_are_warm_up_too() -> None:
    pol = policy(prefill_capacity=None, decode_capacity=None)
    dec = asc.decide(pol, asc.State(), WARMUP, asc.PoolView(4, 2), asc.PoolView(4, 2), 5000.0)
    assert dec.state.prefill.learned_capacity is None and dec.state.decode.learned_capacity is None


# ---- 4. prefix-cache hits ------------------------------------------------------------------------------

def test_prefix_hits_discount_the_prompt_tokens() -> None:
    # 10 req/s x 2000 tokens, 75% served from the prefix cache: prefill computes 500 tokens per request
    o = obs(10, prefix_hit_rate=0.75)
    dec = asc.decide(policy(), asc.State(), o, asc.PoolView(1, 1), asc.PoolView(1, 1), 0.0)
    assert dec.prefill.desired == 1  # 1.5*10*500/10000 = 0.75; without the discount: 3
    assert dec.inputs["prefixHitRate"] == 0.75 and dec.inputs["meanInputTokens"] == 2000
    off = asc.decide(policy(use_prefix_hits=False), asc.State(), o, asc.PoolView(1, 1), asc.PoolView(1, 1), 0.0)
    assert off.prefill.desired == 3
    assert rules.prefill_tokens(2000, 1.0) == pytest.approx(2000 * (1 - rules.MAX_PREFIX_HIT))
    assert rules.prefill_tokens(2000, float("nan")) == 2000


# ---- 5. bursts -----------------------------------------------------------------------------------------

def test_a_burst_within_the_window_must_fit_without_headroom() -> None:
    # mean 4 req/s (needs 1.2 -> 2), but 30 s at 20 req/s inside the window: 20*2000/10000 = 4 instances
    dec = asc.decide(policy(), asc.State(), obs(4, peak_request_rate=20.0), asc.PoolView(2, 2),
                     asc.PoolView(2, 2), 0.0)
    assert dec.prefill.desired == 4 and dec.inputs["peakRequestRate"] == 20.0
    # decode: 20*400/2000 = 4 as well
    assert dec.decode.desired == 4


def test_a_burst_that_broke_the_slo_is_remembered_longer_than_a_level() -> None:
    pol = policy(stabilization_seconds=300, burst_memory_seconds=1800, max_down_step=10, slo_ttft_seconds=5.0)
    # a 30 s burst at 20 req/s inside a quiet window (mean 2 req/s): 20*0.2 = 4 prefill instances
    hurt = obs(2, peak_request_rate=20.0, ttft_seconds=30.0)
    decs = run(pol, asc.State(), [hurt] + [obs(0.5, peak_request_rate=1.0)] * 30, 1, 1)
    assert decs[0].prefill.desired == 4
    assert all(d.prefill.desired == 4 for d in decs[1:]), [d.prefill.desired for d in decs]  # 15 min later
    # the same burst absorbed within the SLO is not remembered past the stabilization period
    fine = obs(2, peak_request_rate=20.0, ttft_seconds=1.0)
    decs = run(pol, asc.State(), [fine] + [obs(0.5, peak_request_rate=1.0)] * 30, 1, 1)
    assert decs[0].prefill.desired == 4 and decs[-1].prefill.desired == 1
    # a plateau (peak close to its mean) is a level: it goes after the stabilization period (smooth, so the
    # adaptive headroom is 1 + 0.5*(14/12 - 1) = 1.08: 12*0.2*1.08 = 2.6 -> 3)
    decs = run(pol, asc.State(), [obs(12, peak_request_rate=14.0)] * 4 + [obs(0.5, peak_request_rate=1.0)] * 30,
               1, 1)
    assert decs[3].prefill.desired == 3 and decs[-1].prefill.desired == 1
    # and the remembered bursts expire after burst_memory_seconds
    decs = run(pol, asc.State(), [hurt] + [obs(0.5, peak_request_rate=1.0)] * 75, 1, 1)
    assert decs[-1].prefill.desired == 1


def test_a_breach_without_a_queue_grows_nothing() -> None:
    # one huge prompt is slow on any pool size: TTFT p99 broken, but nothing waited in front of prefill
    pol = policy(slo_ttft_seconds=2.0)
    o = obs(4, ttft_seconds=6.0, prefill_queue_mean=0.1)
    dec = asc.decide(pol, asc.State(), o, asc.PoolView(3, 3), asc.PoolView(3, 3), 1000.0)
    assert dec.prefill.desired == 3 and dec.prefill.slo_breached and dec.prefill.reason != asc.SLO_GUARD
    assert dec.state.prefill.capacity_scale == 1.0
    o = obs(4, ttft_seconds=2.5, prefill_queue_mean=3.0)
    assert asc.decide(pol, asc.State(), o, asc.PoolView(3, 3), asc.PoolView(3, 3), 1000.0).prefill.desired == 4


def test_the_guard_never_piles_replicas_onto_pending_pods() -> None:
    # The SLO is broken and the new pod stays Pending (no GPU left): past the rollout timeout the autoscaler
    # still decides (no wedge) on the formula, but the guard does not add to pods that never started.
    pol = policy(slo_ttft_seconds=2.0, rollout_timeout_seconds=600)
    o = obs(4, ttft_seconds=2.5, prefill_queue_mean=5.0)
    dec = asc.decide(pol, asc.State(), o, asc.PoolView(3, 3), asc.PoolView(3, 3), 1000.0)
    assert dec.prefill.desired == 4
    stuck = asc.PoolView(4, 3)
    dec = asc.decide(pol, dec.state, o, stuck, asc.PoolView(3, 3), 1300.0)
    assert dec.prefill.reason == asc.ROLLOUT and dec.prefill.desired == 4
    dec = asc.decide(pol, dec.state, obs(12, ttft_seconds=2.5, prefill_queue_mean=5.0), stuck,
                     asc.PoolView(3, 3), 1700.0)
    assert "rollout-stalled" in dec.limited_by and dec.prefill.reason == asc.SCALE_UP  # the formula: 3.6 -> 4+
    dec = asc.decide(pol, dec.state, o, asc.PoolView(dec.prefill.desired, 3), asc.PoolView(3, 3), 2400.0)
    assert dec.prefill.reason != asc.SLO_GUARD and dec.state.prefill.slo_breaches == 1


# ---- 6. what the real traces asked of the headroom, the guard and decode (issue 13, §2 goals) ------------

def test_the_headroom_follows_the_windows_variability_with_the_spec_as_ceiling() -> None:
    # Mooncake: smooth load (peak 10 s rate 1.0-1.8x the mean) paid the fixed 1.5x for nothing (1.55x the
    # instance-hours of static-best). 12 req/s x 2000 / 10k = 2.4 instances.
    smooth = obs(12, peak_request_rate=12.5)  # h = 1 + 0.5 * (12.5/12 - 1) = 1.02 -> 2.45 -> 3
    dec = asc.decide(policy(), asc.State(), smooth, asc.PoolView(1, 1), asc.PoolView(1, 1), 0.0)
    assert dec.prefill.desired == 3 and dec.inputs["headroom"] == pytest.approx(1.0208, abs=1e-3)
    assert dec.inputs["headroomCeiling"] == 1.5
    fixed = asc.decide(policy(adaptive_headroom=False), asc.State(), smooth, asc.PoolView(1, 1),
                       asc.PoolView(1, 1), 0.0)
    assert fixed.prefill.desired == 4  # 1.5 * 2.4 = 3.6
    # the spec's headroom is the ceiling: reached at a peak of bursty_ratio (2) x the mean, never passed
    assert rules.effective_headroom(1.5, 10.0, 15.0, 2.0) == pytest.approx(1.25)
    assert rules.effective_headroom(1.5, 10.0, 20.0, 2.0) == pytest.approx(1.5)
    assert rules.effective_headroom(1.5, 10.0, 90.0, 2.0) == pytest.approx(1.5)
    assert rules.effective_headroom(1.5, 10.0, 8.0, 2.0) == pytest.approx(1.0)
    # no peak series (burstWindowSeconds 0, or an old Prometheus): the ceiling, as before
    assert rules.effective_headroom(1.5, 10.0, None, 2.0) == 1.5
    assert rules.effective_headroom(1.5, 0.0, 3.0, 2.0) == 1.5
    # and the CRD switch reaches the policy
    spec = parse_spec({"model": {"name": "m", "uri": "file:///m"}, "image": "x:1",
                       "autoscaling": {"adaptiveHeadroom": False, "headroom": 1.3}})
    assert not asc.Policy.from_spec(spec).adaptive_headroom and asc.Policy.from_spec(spec).headroom == 1.3
    assert asc.Policy.from_spec(parse_spec({"model": {"name": "m", "uri": "file:///m"}, "image": "x:1"})
                                ).adaptive_headroom


def test_a_breach_whose_queue_adds_little_wait_grows_nothing() -> None:
    # Mooncake: the window's p99 TTFT broke 15 s at 7 prefill with a mean queue of 3.6 at 2.7 req/s, i.e.
    # 1.3 s of queueing (Little): the p99 was one 126k-token prompt (12.6 s of prefill on any pool size).
    # The guard grew the pool to 9 and cut its capacity to 0.72 for ten minutes.
    pol = policy(slo_ttft_seconds=15.0, headroom=1.0)
    o = obs(2.7, i=14000, ttft_seconds=16.0, prefill_queue_mean=3.6)
    dec = asc.decide(pol, asc.State(), o, asc.PoolView(7, 7), asc.PoolView(1, 1), 1000.0)
    assert dec.prefill.slo_breached and dec.prefill.reason != asc.SLO_GUARD and dec.prefill.desired == 7
    assert dec.state.prefill.capacity_scale == 1.0
    # a queue that does add a real wait (30 requests at 2.7 req/s: 11 s) still grows the pool
    o = obs(2.7, i=14000, ttft_seconds=16.0, prefill_queue_mean=30.0)
    dec = asc.decide(pol, asc.State(), o, asc.PoolView(7, 7), asc.PoolView(1, 1), 1000.0)
    assert dec.prefill.reason == asc.SLO_GUARD and dec.prefill.desired == 8
    assert rules.guard_applies(None, 2.7, 15.0) and not rules.guard_applies(0.4, 0.01, 15.0)


def test_a_decode_burst_spreads_over_the_ttft_target_too() -> None:
    # Mooncake: peaks of 6-7 req/s x 343 output tokens / 2000 = 1.2 decode instances kept decode at 2 where
    # 1 meets the SLO. A burst's requests may wait for a decode slot within the TTFT target as they may for
    # prefill (a full batch delays the first token, not TPOT), so decode needs b/(b+TTFT) of the peak too.
    pol = policy(slo_ttft_seconds=15.0, burst_window_seconds=10.0)
    o = obs(3, i=12000, o=343, peak_request_rate=7.0)
    dec = asc.decide(pol, asc.State(), o, asc.PoolView(5, 5), asc.PoolView(1, 1), 0.0)
    # 3 x 0.1715 x 1.5 = 0.77 and 7 x 0.1715 x 10/25 = 0.48: one decode instance
    assert dec.decode.desired == 1
    assert rules.burst_spread("decode", 10.0, 15.0) == rules.burst_spread("prefill", 10.0, 15.0) == 0.4
    assert rules.burst_spread("decode", 10.0, None) == 1.0


def test_a_far_broken_percentile_grows_the_pool_in_proportion_capped_by_the_step() -> None:
    # Azure with no history: p99 TTFT 77 s against 5 s with a long queue. One replica per window took three
    # windows (3 -> 4 -> 5) while the queue held 100 requests; now current x observed/target, at most
    # maxScaleUpStep at once.
    pol = policy(slo_ttft_seconds=5.0, max_up_step=4)
    dec = asc.decide(pol, asc.State(), obs(5, ttft_seconds=77.0, prefill_queue_mean=100.0), asc.PoolView(3, 3),
                     asc.PoolView(1, 1), 1000.0)
    assert dec.prefill.reason == asc.SLO_GUARD and dec.prefill.desired == 7
    assert rules.guard_step(3, 77.0, 5.0) == 44 and rules.guard_step(3, 6.0, 5.0) == 1
    assert rules.guard_step(3, None, 5.0) == 1 and rules.guard_step(3, float("inf"), 5.0) == 1
