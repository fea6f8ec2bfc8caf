"""`keda-tokens` (bench/sim/keda.py): llm-d's token-aware KEDA ScaledObjects as the HPA runs them, the peer
`simulate` can compare against."""

from __future__ import annotations

import pytest

from pdcluster.bench.sim import keda
from pdcluster.bench.sim import policies as pol
from pdcluster.bench.sim.cluster import simulate
from pdcluster.bench.sim.hpa import HpaPool
from pdcluster.bench.sim.model import SLO, ServiceModel
from pdcluster.bench.sim.observe import PolicyInput
from pdcluster.bench.trace import Request, Trace
from pdcluster.operator.planner import Bounds


def test_the_hpa_grows_one_pod_per_period_and_shrinks_after_its_window() -> None:
    p = HpaPool()
    # 9 s of backlog at 1.5 s a replica asks for 6: one pod now, none more within 180 s
    assert p.step(keda.BEHAVIOR, 0.0, 2, 9.0, 1.5, 1, None) == 3
    assert p.step(keda.BEHAVIOR, 15.0, 3, 9.0, 1.5, 1, None) == 3
    assert p.step(keda.BEHAVIOR, 180.0, 3, 9.0, 1.5, 1, None) == 4
    # within the 10 % tolerance nothing moves
    assert HpaPool().step(keda.BEHAVIOR, 0.0, 4, 6.3, 1.5, 1, None) == 4
    # the load is gone: the highest recommendation of the last 300 s holds the pool, then one pod per 300 s
    assert p.step(keda.BEHAVIOR, 200.0, 4, 0.0, 1.5, 1, None) == 4
    assert p.step(keda.BEHAVIOR, 481.0, 4, 0.0, 1.5, 1, None) == 3
    assert p.step(keda.BEHAVIOR, 600.0, 3, 0.0, 1.5, 1, None) == 3
    assert p.step(keda.BEHAVIOR, 781.0, 3, 0.0, 1.5, 1, None) == 2
    # the replica bounds
    assert HpaPool().step(keda.BEHAVIOR, 0.0, 1, 0.0, 1.5, 1, None) == 1
    assert HpaPool().step(keda.BEHAVIOR, 0.0, 4, 90.0, 1.5, 1, 4) == 4


def test_the_prefill_target_is_the_ttft_budget_less_one_prompt() -> None:
    assert keda.KedaTokens.target_s(5.0, 2_000, 10_000) == pytest.approx(4.8)
    assert keda.KedaTokens.target_s(2.0, 30_000, 10_000) == keda.MIN_PREFILL_TARGET_S


def test_each_pool_reads_its_own_gauge() -> None:
    k = keda.KedaTokens(Bounds(1, 8, 1, 8), 10_000.0, 1.5)
    inp = PolicyInput(now=0.0, observation=None, prefill_current=1, prefill_ready=1, decode_current=1,
                      decode_ready=1, prefill_utilisation=None, decode_utilisation=None,
                      prefill_inflight_tokens=45_000.0, decode_occupancy=0.5)
    assert k.decide(inp) == (2, 1)  # 4.5 s of backlog asks for 3 prefill (one now); half a batch is 1 decode
    inp = PolicyInput(now=0.0, observation=None, prefill_current=1, prefill_ready=1, decode_current=1,
                      decode_ready=1, prefill_utilisation=None, decode_utilisation=None,
                      prefill_inflight_tokens=0.0, decode_occupancy=2.0)
    assert keda.KedaTokens(Bounds(1, 8, 1, 8), 10_000.0, 1.5).decide(inp) == (1, 2)


def test_a_backlog_of_prompts_grows_the_prefill_pool_in_the_simulator() -> None:
    """12k-token prompts at 2 req/s: 2.4 instances of prefill work; the policy ticks every 15 s and the
    simulator hands it the prompt tokens in flight, so prefill grows, one pod per 180 s."""
    reqs = tuple(Request(0.5 * i, 12_000, 20) for i in range(1200))
    trace = Trace(reqs, "synthetic", "test")
    policy = pol.make("keda-tokens", 10_000.0, 2_000.0, trace=trace, slo=SLO())
    assert isinstance(policy, keda.KedaTokens) and policy.interval_s == keda.POLL_S
    r = simulate(trace, ServiceModel(), policy)
    sizes = [(t, p) for t, p, *_ in r.timeline]
    ups = [t for (_, p), (t, q) in zip(sizes, sizes[1:], strict=False) if q > p]
    assert ups and all(b - a >= keda.BEHAVIOR.up_period_s for a, b in zip(ups, ups[1:], strict=False))
    assert max(p for _, p in sizes) >= 3
