"""The fast scale-up path in the simulator (`operator/autoscaler_fast.py`, `Core.fast`): between two
decisions it reads the queue gauges as last sampled (a scrape late), and a backlog growing past the TTFT
target grows the pool before the next windowed decision would."""

from __future__ import annotations

from pdcluster.bench.sim import policies as pol
from pdcluster.bench.sim.cluster import simulate
from pdcluster.bench.sim.model import SLO, ServiceModel

from .test_simulator import check_conservation, synthetic

M = ServiceModel()


def step(t: float) -> float:  # 2 req/s of 2k-token prompts, then 15 req/s from 305 s (just after a decision)
    return 15.0 if t >= 305 else 2.0


def first_growth(log: list[dict], after: float) -> dict:
    return next(r for r in log if r["t"] > after and r["prefill_desired"] > r["prefill_current"])


def test_a_growing_backlog_grows_prefill_between_decisions_a_scrape_late() -> None:
    trace, slo = synthetic(step, 600.0, seed=3), SLO()
    runs = {}
    for fast_s in (0.0, 10.0):
        p = pol.make("pdcluster", M.prefill_tps, M.decode_tps, trace=trace, slo=slo, fast_s=fast_s)
        p.log = []
        runs[fast_s] = (simulate(trace, M, p), p)
    slow_p, (quick, quick_p) = runs[0.0][1], runs[10.0]
    check_conservation(trace, quick)
    up_slow, up_quick = first_growth(slow_p.log, 305.0), first_growth(quick_p.log, 305.0)
    assert up_quick["t"] < up_slow["t"]
    assert up_quick["t"] % 30 != 0 and up_quick["reason"] == "SLOBreached"  # a fast tick, not a decision
    # it saw the queue of a sample before (the sampler's 12 s step), never the arrivals: a growing queue
    assert up_quick["prefill_queue_now"] > 0
    assert sum(v for k, v in quick.steps_by_cause.items() if k.startswith("prefill:")) >= 1
    assert quick_p.state.prefill.slo_breaches >= 1
    # without a TTFT target there is nothing to guard: the fast path never acts
    p = pol.make("pdcluster", M.prefill_tps, M.decode_tps, trace=trace, fast_s=10.0)
    p.log = []
    simulate(trace, M, p)
    assert all(r["t"] % 30 == 0 for r in p.log)
