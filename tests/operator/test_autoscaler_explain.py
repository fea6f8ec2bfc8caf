"""Each pool's step explained by its cause (formula, burst, slo-guard, bound, stabilization, limit, hold)."""

from __future__ import annotations

from pdcluster.operator import autoscaler as asc
from pdcluster.operator import autoscaler_explain as ex
from pdcluster.operator import opmetrics, scaling
from pdcluster.operator.models import parse_spec
from pdcluster.operator.naming import Owner
from pdcluster.operator.planner import Bounds

from .test_autoscaler_guards import obs, policy, run

BASE = {"model": {"name": "m", "uri": "file:///m"}, "image": "x:1"}


def decide(pol, o, p, d, now=1000.0, state=None, ready=None):
    ready = ready or (p, d)
    return asc.decide(pol, state or asc.State(), o, asc.PoolView(p, ready[0]), asc.PoolView(d, ready[1]), now)


def test_formula_and_burst():
    # mean 10 req/s: 10 x 2000/10000 x 1.5 = 3 prefill, from the mean rate with headroom
    dec = decide(policy(), obs(10), 1, 1)
    assert ex.causes(dec) == {"prefill": "formula", "decode": "formula"}
    assert ex.message(dec) == "prefill 1->3 (formula), decode 1->3 (formula): ScaleUp"
    # mean 4 req/s but a 20 req/s peak: 4 instances come from the burst
    dec = decide(policy(), obs(4, peak_request_rate=20.0), 2, 2)
    assert dec.prefill.desired == 4 and ex.pool_cause(dec, "prefill") == "burst"


def test_slo_guard_bound_and_limit():
    dec = decide(policy(slo_ttft_seconds=2.0), obs(4, ttft_seconds=2.5, prefill_queue_mean=3.0), 3, 3)
    assert dec.prefill.desired == 4 and ex.pool_cause(dec, "prefill") == "slo-guard"
    # the formula's 15 prefill above maxReplicas 5
    dec = decide(policy(bounds=Bounds(1, 5, 1, 32)), obs(50), 1, 1)
    assert dec.prefill.desired == 5 and ex.pool_cause(dec, "prefill") == "bound"
    # maxScaleUpStep 2: 1 -> 3 of the 15 asked for
    dec = decide(policy(max_up_step=2), obs(50), 1, 1)
    assert dec.prefill.desired == 3 and ex.pool_cause(dec, "prefill") == "limit"
    # maxTotalReplicas: both pools cut to the budget
    dec = decide(policy(bounds=Bounds(1, 32, 1, 32, max_total=6)), obs(50), 1, 1)
    assert dec.prefill.desired + dec.decode.desired == 6 and ex.causes(dec)["prefill"] == "limit"


def test_stabilization_and_hold():
    pol = policy(stabilization_seconds=300)
    decs = run(pol, asc.State(), [obs(40)] + [obs(4)] * 3, 1, 1)
    assert decs[-1].prefill.reason == asc.STABILIZING and ex.pool_cause(decs[-1], "prefill") == "stabilization"
    dec = decide(pol, None, 3, 3)  # no metrics
    assert ex.causes(dec) == {"prefill": "hold", "decode": "hold"}
    starting = asc.State(prefill=asc.PoolState(last_change=970.0))
    dec = decide(pol, obs(8), 3, 3, ready=(1, 3), state=starting)  # pods still starting, ordered for the load
    assert dec.prefill.desired == 3 and ex.pool_cause(dec, "prefill") == "hold"


def test_a_remembered_burst_holding_the_pool_is_burst():
    pol = policy(stabilization_seconds=300, burst_memory_seconds=1800, max_down_step=10, slo_ttft_seconds=5.0)
    hurt = obs(2, peak_request_rate=20.0, ttft_seconds=30.0)
    decs = run(pol, asc.State(), [hurt] + [obs(0.5, peak_request_rate=1.0)] * 20, 1, 1)
    assert decs[-1].prefill.desired == 4 and ex.pool_cause(decs[-1], "prefill") == "burst"


def test_every_cause_is_in_the_vocabulary_and_counted_by_the_metric():
    dec = decide(policy(max_up_step=2), obs(50), 1, 1)
    assert set(ex.causes(dec).values()) <= set(ex.CAUSES)
    step = scaling.Step(desired={"prefill": 3, "decode": 3}, next_delay=30.0, decision=dec)

    def count(role: str, cause: str) -> float:
        v = opmetrics.REGISTRY.get_sample_value("pdcluster_autoscaler_scaling_steps_total",
                                                {"namespace": "ns", "pdcluster": "explained", "role": role,
                                                 "cause": cause})
        return v or 0.0

    before = count("prefill", "limit"), count("decode", "limit")
    scaling.record_metrics(Owner("explained", "ns", "uid"), parse_spec(BASE), step)
    # one step per pool that changed, labelled with its cause
    assert (count("prefill", "limit"), count("decode", "limit")) == (before[0] + 1, before[1] + 1)
