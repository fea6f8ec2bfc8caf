"""The reactive oracle (the core fed the true arrival rate) and the infeasible-request accounting."""

from __future__ import annotations

from pdcluster.bench.sim import policies as pol
from pdcluster.bench.sim.cli import run_policy
from pdcluster.bench.sim.cluster import simulate
from pdcluster.bench.sim.feasibility import feasibility
from pdcluster.bench.sim.model import SLO, ServiceModel
from pdcluster.bench.sim.oracle import Arrivals, ReactiveOracle
from pdcluster.bench.sim.report import dominated_by, policy_summary
from pdcluster.bench.trace import Request, Trace

from .test_simulator import synthetic

M = ServiceModel()


def step_up(t: float) -> float:  # 1 rps for 5 minutes, then 10 rps
    return 10.0 if t >= 300 else 1.0


def first_scale_up(r) -> float:
    p0 = r.timeline[0][1]
    return next(t for t, p, *_ in r.timeline if p > p0)


def test_oracle_sees_a_step_before_the_operator_and_pays_the_same_pod_start():
    trace = synthetic(step_up, 900)
    slo = SLO(ttft_s=5.0)
    core = pol.make("pdcluster", M.prefill_tps, M.decode_tps, slo=slo)
    oracle = pol.make("reactive-oracle", M.prefill_tps, M.decode_tps, slo=slo, trace=trace)
    assert isinstance(oracle, ReactiveOracle)
    r_core, r_oracle = simulate(trace, M, core), simulate(trace, M, oracle)
    # the step at 300 s: the oracle decides every 10 s on the last 10 s of arrivals; the operator reads a
    # 120 s window every 30 s, whose mean crosses a replica boundary later
    assert 300 <= first_scale_up(r_oracle) <= 310
    assert first_scale_up(r_oracle) < first_scale_up(r_core)
    # pods it asks for are ready pod_start_s later, as for every policy
    t_up = first_scale_up(r_oracle)
    p_ready = {t: ready for t, _, _, ready, _, _ in r_oracle.timeline}
    assert p_ready[t_up + 50] == r_oracle.timeline[0][3]
    assert p_ready[t_up + 70] > r_oracle.timeline[0][3]


def test_oracle_is_primed_like_the_others():
    trace = synthetic(step_up, 600)
    oracle = pol.make("reactive-oracle", M.prefill_tps, M.decode_tps, trace=trace)
    first = simulate(trace, M, oracle)
    carried = pol.carry_over(oracle, trace.duration_s, (first.timeline[-1][1], first.timeline[-1][2]))
    assert isinstance(carried, ReactiveOracle) and carried.arrivals is oracle.arrivals
    assert carried.initial() == (first.timeline[-1][1], first.timeline[-1][2])


def test_arrivals_window_sums():
    trace = Trace((Request(0.0, 10, 1), Request(1.0, 20, 2), Request(2.5, 40, 0)), "synthetic", "t")
    a = Arrivals.of(trace)
    assert a.between(0.0, 2.5) == (2, 60, 3)  # (t0, t1]: the first request is out; output >= 1
    assert a.between(-1.0, 0.5) == (1, 10, 1)
    assert a.between(3.0, 9.0) == (0, 0, 0)


def test_infeasible_requests_and_their_reasons():
    reqs = (Request(0.0, 1000, 10, (7,)), Request(1.0, 60_000, 10, (1, 2, 3)),  # 6 s of prefill at 10k/s
            Request(2.0, 60_000, 10, (1, 2, 3)),  # the same prompt again: a prefix hit could save it
            Request(3.0, 2000, 10, None))
    trace = Trace(reqs, "mooncake", "t", block_tokens=20_000)
    f = feasibility(trace, M, SLO(ttft_s=5.0))
    assert f.feasible == (True, False, False, True)
    assert f.why == {"prefill_exceeds_ttft": 2, "decode_step_exceeds_tpot": 0}
    assert f.prefix_could_rescue == 1  # the repeat: all its blocks were held before
    doc = f.summary(SLO(ttft_s=5.0), M)
    assert doc["count"] == 2 and doc["share"] == 0.5 and "TTFT 5 s" in doc["rule"]
    # a TPOT below a lone sequence's step: every request with more than one output token
    slow = feasibility(trace, M, SLO(ttft_s=60.0, tpot_s=0.001))
    assert slow.why["decode_step_exceeds_tpot"] == 4 and slow.infeasible == 4


def test_attainment_over_feasible_requests():
    reqs = tuple(Request(float(i), 60_000 if i % 4 == 0 else 1000, 5) for i in range(40))
    trace = Trace(reqs, "azure", "t")
    slo = SLO(ttft_s=5.0)
    f = feasibility(trace, M, slo)
    s = policy_summary(simulate(trace, M, pol.Static(8, 1)), slo, f.feasible)
    assert f.infeasible == 10
    assert s["slo_attainment"] == 0.75  # the 60k-token prompts take 6 s on any pool
    assert s["slo_attainment_feasible"] == 1.0


def test_dominated_by_needs_both_more_attainment_and_less_cost():
    ps = {"a": {"slo_attainment": 0.9, "instance_hours": 5.0},
          "b": {"slo_attainment": 0.95, "instance_hours": 4.0},  # dominates a
          "c": {"slo_attainment": 0.99, "instance_hours": 6.0},  # better, dearer
          "d": {"slo_attainment": 0.9, "instance_hours": 3.0}}  # as good, cheaper: not strictly better
    assert dominated_by(ps, "a") == ["b"]
    assert dominated_by(ps, "c") == []


def test_primed_on_another_trace_the_oracle_reads_the_measured_one():
    """`run_policy(..., prime=other)`: the first pass over `other`, the measured pass over the trace, and the
    oracle's true arrivals are the measured trace's (it would otherwise read the priming hour's)."""
    quiet = Trace(tuple(Request(t=float(i), input_tokens=500, output_tokens=10) for i in range(0, 600, 5)),
                  "synthetic", "test")
    busy = Trace(tuple(Request(t=i / 4, input_tokens=4000, output_tokens=10) for i in range(2400)),
                 "synthetic", "test")
    policy = pol.make("reactive-oracle", 10_000.0, 2_000.0, trace=quiet, slo=SLO())
    moved = pol.for_trace(policy, busy)
    assert moved.arrivals.times == Arrivals.of(busy).times and policy.arrivals.times == Arrivals.of(quiet).times
    assert pol.for_trace(pol.make("pdcluster", 10_000.0, 2_000.0, trace=quiet), busy).name == "pdcluster"
    r = run_policy(busy, ServiceModel(), SLO(), "reactive-oracle", primed=True, prime=quiet)
    assert len(r.arrival) == len(busy.requests) and r.max_prefill >= 2  # it saw the busy hour's 10k tok/s
