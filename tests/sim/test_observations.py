"""What the simulated Prometheus shows the autoscaler beyond λ/I/O: latency quantiles, peak λ, prefix hits;
and the priming pass."""

from __future__ import annotations

import pytest

from pdcluster.bench.sim import policies as pol
from pdcluster.bench.sim.cluster import simulate
from pdcluster.bench.sim.model import SLO, ServiceModel
from pdcluster.bench.sim.observe import Counters, Sampler, histogram_quantile
from pdcluster.bench.trace import Request, Trace


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    buckets = (0.5, 1.0, 5.0)
    values = [0.1] * 60 + [0.7] * 30 + [2.0] * 10
    # rank 95 of 100 lies halfway through the (1, 5] bucket's 10 observations
    assert histogram_quantile(0.95, buckets, values) == pytest.approx(3.0)
    assert histogram_quantile(0.5, buckets, values) == pytest.approx(0.5 * 50 / 60)
    assert histogram_quantile(0.99, buckets, [9.0] * 5) == 5.0  # +Inf bucket: the highest finite bound
    assert histogram_quantile(0.99, buckets, []) is None


def test_sampler_peak_rate_and_windowed_quantiles() -> None:
    s = Sampler(window_s=120, burst_s=10, percentile=0.99)
    s.admit_times = [float(t) for t in range(0, 100, 10)] + [100 + i / 10 for i in range(50)]  # 5 s burst
    assert s.peak_rate(120.0) == pytest.approx(5.0)  # 50 requests in the 10 s window
    s.ttft = [(10.0, 30.0), (119.0, 0.2)]
    c = Counters(admitted=60, prompt_tokens=6000, prefill_tokens=6000, generated=600.0, prefix_hit_tokens=1500)
    s.record_counters(0.0, Counters())
    s.record_counters(120.0, c)
    s.record_queues(120.0, 0, 0)
    o = s.observation(130.0, 1, 1)
    assert o is not None and o.prefix_hit_rate == pytest.approx(0.25)
    assert o.ttft_seconds is not None and o.ttft_seconds < 1.0  # the 30 s TTFT at t=10 left the window
    assert o.tpot_seconds is None  # no TPOT observed in the window


def _shared_prefix_trace(n: int = 40) -> Trace:
    # every request repeats the same 8 blocks of 512 tokens, then 1 block of its own
    reqs = tuple(Request(i * 2.0, 9 * 512, 4, tuple(range(8)) + (1000 + i,)) for i in range(n))
    return Trace(reqs, "mooncake", "test")


def test_prefix_cache_hits_shorten_prefill_and_conserve_tokens() -> None:
    trace = _shared_prefix_trace()
    with_cache = simulate(trace, ServiceModel(), pol.Static(1, 1))
    without = simulate(trace, ServiceModel(prefix_cache_tokens=0), pol.Static(1, 1))
    # after the first request, 8 of 9 blocks hit
    assert with_cache.prefix_hit_tokens == 8 * 512 * (len(trace.requests) - 1)
    assert without.prefix_hit_tokens == 0
    # prompt tokens are counted whole either way (as pdcluster_prompt_tokens_total does)
    assert with_cache.prefilled_tokens == without.prefilled_tokens == 9 * 512 * len(trace.requests)
    ttft = lambda r: sum(f - a for f, a in zip(r.first_token, r.arrival, strict=True))  # noqa: E731
    assert ttft(with_cache) < ttft(without)


def test_a_tiny_cache_evicts() -> None:
    trace = _shared_prefix_trace()
    r = simulate(trace, ServiceModel(prefix_cache_tokens=4 * 512), pol.Static(1, 1))
    assert r.prefix_hit_tokens < 8 * 512 * (len(trace.requests) - 1)


def test_priming_carries_state_and_sizes_back_in_time() -> None:
    m = ServiceModel()
    reqs = tuple(sorted([Request(float(t), 2000, 50) for t in range(0, 1500)] + [
        Request(600 + t / 20, 2000, 50) for t in range(600)], key=lambda r: r.t))  # 1 req/s, a 30 s burst
    trace = Trace(reqs, "azure", "test")
    first = pol.make("pdcluster", m.prefill_tps, m.decode_tps, trace=trace, slo=SLO(ttft_s=2.0))
    r = simulate(trace, m, first)
    primed = pol.carry_over(first, trace.duration_s, (r.timeline[-1][1], r.timeline[-1][2]))
    assert primed.initial() == (r.timeline[-1][1], r.timeline[-1][2])
    lc = first.state.prefill.last_change
    assert lc is not None and primed.state.prefill.last_change == pytest.approx(lc - trace.duration_s)
    assert all(t < 0 for t, _ in primed.state.prefill.recent_needs)
    assert primed.core == first.core and primed.decisions == []


def test_the_queue_now_is_the_latest_sample():
    from pdcluster.bench.sim.observe import Counters, Sampler

    s = Sampler(window_s=120.0)
    c = Counters()
    s.record_counters(0.0, c)
    for k, (p, d) in enumerate([(5, 1), (9, 0), (2, 3)]):
        s.record_queues(12.0 * k, p, d)
    c.admitted = 10
    s.record_counters(30.0, c)
    o = s.observation(30.0, 1, 1)
    assert o is not None and o.prefill_queue_now == 2.0 and o.decode_queue_now == 3.0
    assert o.prefill_queue_mean == (5 + 9 + 2) / 3


def test_o_by_completion_is_the_mean_length_of_the_requests_that_finished():
    """Counters.finished / finished_tokens (the router's pdcluster_request_generation_tokens): every request
    that ends is counted once with its whole length, and the windows report their mean."""
    reqs = [Request(t=0.1 * k, input_tokens=100, output_tokens=o) for k, o in enumerate([1, 50, 400, 7] * 5)]
    trace = Trace(tuple(reqs), schema="mooncake", source="t")
    policy = pol.make("static-1:1", 10_000.0, 2_000.0)
    from pdcluster.bench.sim.cluster import Cluster

    c = Cluster(trace, ServiceModel(), policy)
    c.run()
    assert c.c.finished == len(reqs) and c.c.finished_tokens == sum(r.output_tokens for r in reqs)
    s = Sampler(window_s=120.0)
    s.record_counters(0.0, Counters())
    s.record_counters(60.0, c.c)
    assert s.observation(60.0, 1, 1).finished_output_tokens == pytest.approx((1 + 50 + 400 + 7) / 4)
    assert s.short(60.0, 60.0).finished_output_tokens == pytest.approx((1 + 50 + 400 + 7) / 4)


def test_with_a_scrape_interval_every_step_reads_the_counters_of_the_last_scrape():
    """`ServiceModel.scrape_s` (`simulate --scrape-interval`): counters are sampled on their own grid, half an
    interval off the autoscaler's steps, and never at a step; without it every step samples them exactly."""
    from pdcluster.bench.sim.cluster import Cluster

    reqs = tuple(Request(t=0.25 * k, input_tokens=2_000, output_tokens=100) for k in range(400))
    trace = Trace(reqs, schema="mooncake", source="t")
    seen: list[tuple[float, float]] = []

    def spy(policy):
        inner = policy.decide

        def decide(inp):
            seen.append((inp.now, c.sampler.times[-1]))
            return inner(inp)
        policy.decide = decide
        return policy

    policy = spy(pol.make("pdcluster", 10_000.0, 2_000.0, trace=trace))
    c = Cluster(trace, ServiceModel(scrape_s=5.0), policy)
    c.run()
    assert [t for t in c.sampler.times if t] == [2.5 + 5 * k for k in range(len(c.sampler.times) - 1)]
    assert seen and all(last == now - 2.5 for now, last in seen)  # as of the scrape 2.5 s before each decision
    policy = spy(pol.make("pdcluster", 10_000.0, 2_000.0, trace=trace))
    seen.clear()
    c = Cluster(trace, ServiceModel(), policy)
    c.run()
    assert seen and all(last == now for now, last in seen)
    with pytest.raises(ValueError, match="scrape interval"):
        ServiceModel(scrape_s=-1.0)


def test_the_prompt_length_scv_is_read_from_the_routers_buckets_of_finished_requests():
    """Sampler.prompts (the router's pdcluster_request_prompt_tokens, observed as each request ends): the SCV of the
    prefill tail need, from LENGTH_BUCKETS as Prometheus would hold them, over SCV_WINDOW_SECONDS."""
    from pdcluster.operator.autoscaler_tail import SCV_WINDOW_SECONDS, histogram_scv

    reqs = [Request(t=0.1 * k, input_tokens=n, output_tokens=2) for k, n in enumerate([500, 900, 40_000, 700] * 5)]
    trace = Trace(tuple(reqs), schema="mooncake", source="t")
    from pdcluster.bench.sim.cluster import Cluster

    c = Cluster(trace, ServiceModel(), pol.make("static-1:1", 10_000.0, 2_000.0))
    c.run()
    assert sorted(n for _, n in c.sampler.prompts) == sorted(r.input_tokens for r in reqs)
    end = max(t for t, _ in c.sampler.prompts)
    # 5 in (256, 512], 10 in (512, 1024], 5 in (32768, 65536]
    want = histogram_scv([(256.0, 0.0), (512.0, 5.0), (1024.0, 15.0), (32768.0, 15.0), (65536.0, 20.0)])
    assert c.sampler.prompt_scv(end) == pytest.approx(want) and want > 2.0
    assert c.sampler.prompt_scv(end + SCV_WINDOW_SECONDS + 1) is None  # none finished within the range
