"""`simulate --load-aggregation`: the router's placement decision (worker/router/aggregate.py) in the simulated
cluster. A burst of long prompts at a 1:1 cluster: with it, decode instances with free slots prefill some of
them and more requests meet the SLO; nothing is lost and every output token is generated once."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdcluster.bench.sim import policies as pol
from pdcluster.bench.sim.cluster import simulate
from pdcluster.bench.sim.model import SLO, ServiceModel
from pdcluster.bench.sim.report import attainment
from pdcluster.bench.trace import Request, Trace
from pdcluster.worker.router import aggregate as agg

SLO_ = SLO(ttft_s=5.0, tpot_s=0.1)


def burst() -> Trace:
    """1 req/s of 4k-token prompts, then 20 s at 6 req/s (2.4x one prefill instance's 10k tok/s)."""
    reqs, t = [], 0.0
    while t < 120.0:
        reqs.append(Request(t, 4000, 50))
        t += 1 / 6 if 30.0 <= t < 50.0 else 1.0
    return Trace(tuple(reqs), "synthetic", "test")


def test_a_burst_of_long_prompts_is_partly_prefilled_on_decode() -> None:
    trace = burst()
    off = simulate(trace, ServiceModel(), pol.Static(1, 1))
    on = simulate(trace, replace(ServiceModel(), aggregate_ttft_s=SLO_.ttft_s), pol.Static(1, 1))
    assert off.aggregated == 0 and on.aggregated > 0
    assert attainment(on, SLO_) > attainment(off, SLO_)
    n = len(trace.requests)
    for r in (off, on):
        assert all((r.done[i] is not None) != r.rejected[i] for i in range(n))
        served = [i for i in range(n) if not r.rejected[i]]
        assert r.generated_tokens == pytest.approx(sum(r.output_tokens[i] for i in served), rel=1e-9)
    # the prefill pool prefilled exactly the prompts not prefilled on a decode instance
    assert on.prefilled_tokens == off.prefilled_tokens - 4000 * on.aggregated


def test_the_autoscaler_reads_the_load_rules_placements() -> None:
    """What the router's pdcluster_router_placements_total{placement="aggregated",reason="prefill_backlog"}
    counts, per second of the window (the operator's load-aggregated rate: autoscaler_guard.valve_explains)."""
    from pdcluster.bench.sim.cluster import Cluster
    from pdcluster.bench.sim.observe import Counters, Sampler

    c = Cluster(burst(), replace(ServiceModel(), aggregate_ttft_s=SLO_.ttft_s), pol.Static(1, 1))
    result = c.run()
    assert c.c.load_aggregated == result.aggregated > 0
    s = Sampler(window_s=120.0)
    s.record_counters(0.0, Counters())
    s.record_counters(120.0, c.c)
    o = s.observation(120.0, 1, 1)
    assert o is not None and o.load_aggregated_rate == pytest.approx(result.aggregated / 120.0)


def test_prompts_longer_than_a_decode_instance_may_take_stay_on_the_prefill_pool() -> None:
    """40k-token prompts take 4 s on one instance: more than LOCAL_BUDGET of the 5 s target, so however long
    the prefill queue gets, no decode batch is stalled for one."""
    reqs = tuple(Request(float(i) / 2, 40_000, 20) for i in range(40))
    r = simulate(Trace(reqs, "synthetic", "test"), replace(ServiceModel(), aggregate_ttft_s=5.0), pol.Static(1, 1))
    assert 40_000 / ServiceModel().prefill_tps > agg.LOCAL_BUDGET * 5.0
    assert r.aggregated == 0
