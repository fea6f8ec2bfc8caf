"""The autoscaler's Prometheus source against a real Prometheus server (the Debian `prometheus` binary),
scraping a small prometheus_client exporter that this test serves on loopback."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from pdcluster.operator import autoscaler as asc
from pdcluster.operator.autoscaler_tail import histogram_scv
from pdcluster.operator.promsource import MetricsUnavailable, PrometheusSource

from ..netutil import free_port

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None and not os.environ.get("CI"), reason="the prometheus binary is not installed (run `bash scripts/setup.sh test`)")

RATE = 4.0  # requests/s
IN, OUT = 2048, 512
HIT = 0.25  # share of the prefill workers' prompt tokens served from the prefix cache
# TTFT histogram of the router: per request, 60% under 0.5 s, 30% in (0.5, 1], 10% in (1, 5]
TTFT = ((0.5, 0.6), (1.0, 0.9), (5.0, 1.0))
FIN_RATE, FIN_OUT = 3.0, 768  # requests/s finishing, and their mean length (O by completion)
VLLM_FIN_OUT = 640
# the router's prompt-length histogram of finished requests: 80 % up to 1024 tokens, 20 % in (8192, 65536]
PROMPTS = ((1024.0, 0.8), (8192.0, 0.8), (65536.0, 1.0))
AGG_RATE = 0.5  # prompts/s the router's load rule prefilled on decode workers
JOIN = 0.04  # t_join: seconds from a request's KV being complete to its first output on a decode worker


class Workload:
    """pdcluster_* series as a router + 2 prefill + 2 decode workers of PDCluster `demo` would export
    them, with counters that grow at exact rates (computed at scrape time)."""

    def __init__(self) -> None:
        self.t0 = time.time()

    def collect(self):
        # Every sample carries the whole second its value was computed for, so Prometheus stores exact points
        # of the line on a one-second grid whenever the scrape ran (two scrapes in one second store one point).
        now = float(round(time.time()))
        t = now - self.t0
        def counter(name, doc, samples):
            c = CounterMetricFamily(name, doc, labels=["pdcluster", "role", "worker"])
            for labels, value in samples:
                c.add_metric(labels, value, timestamp=now)
            return c
        yield counter("pdcluster_requests_total", "requests", [
            (["demo", "router", "r0"], RATE * t), (["other", "router", "r0"], 100 * t),
            (["vdemo", "router", "r0"], RATE * t)])
        yield counter("pdcluster_prompt_tokens_total", "prompt tokens", [
            (["demo", "router", "r0"], RATE * IN * t), (["vdemo", "router", "r0"], RATE * IN * t),
            (["demo", "prefill", "p0"], RATE * IN * t / 2), (["demo", "prefill", "p1"], RATE * IN * t / 2)])
        yield counter("pdcluster_generation_tokens_total", "generated tokens", [
            (["demo", "router", "r0"], RATE * OUT * t), (["vdemo", "router", "r0"], RATE * OUT * t),
            (["demo", "decode", "d0"], RATE * OUT * t / 2), (["demo", "decode", "d1"], RATE * OUT * t / 2)])
        yield counter("pdcluster_prefix_cache_hit_tokens_total", "prefix hits", [
            (["demo", "prefill", "p0"], HIT * RATE * IN * t / 2), (["demo", "prefill", "p1"], HIT * RATE * IN * t / 2)])
        h = HistogramMetricFamily("pdcluster_time_to_first_token_seconds", "ttft",
                                  labels=["pdcluster", "role", "worker"])
        n = RATE * t
        h.add_metric(["demo", "router", "r0"], [(str(le), share * n) for le, share in TTFT] + [("+Inf", n)],
                     sum_value=n, timestamp=now)
        yield h
        f = HistogramMetricFamily("pdcluster_request_generation_tokens", "finished lengths",
                                  labels=["pdcluster", "role", "worker"])
        f.add_metric(["demo", "router", "r0"], [("+Inf", FIN_RATE * t)], sum_value=FIN_RATE * FIN_OUT * t,
                     timestamp=now)
        yield f
        pt = HistogramMetricFamily("pdcluster_request_prompt_tokens", "finished prompt lengths",
                                   labels=["pdcluster", "role", "worker"])
        pt.add_metric(["demo", "router", "r0"], [(str(le), share * FIN_RATE * t) for le, share in PROMPTS]
                      + [("+Inf", FIN_RATE * t)], sum_value=FIN_RATE * t * 5000, timestamp=now)
        yield pt
        j = HistogramMetricFamily("pdcluster_decode_join_seconds", "join", labels=["pdcluster", "role", "worker"])
        for w in ("d0", "d1"):  # each decode worker admits half the requests
            j.add_metric(["demo", "decode", w], [("0.05", n / 2), ("+Inf", n / 2)], sum_value=JOIN * n / 2,
                         timestamp=now)
        yield j
        k = HistogramMetricFamily("pdcluster_kv_transfer_seconds", "kv", labels=["pdcluster", "role", "worker"])
        for w in ("p0", "p1"):  # every request's KV is saved by its prefill worker; 2 % of them fail
            k.add_metric(["demo", "prefill", w], [("+Inf", 0.98 * n / 2)], sum_value=0.01 * n, timestamp=now)
        yield k
        yield counter("pdcluster_kv_transfer_failures_total", "failed transfers", [
            (["demo", "prefill", "p0"], 0.01 * n), (["demo", "decode", "d0"], 0.01 * n)])
        pl = CounterMetricFamily("pdcluster_router_placements", "placements",
                                 labels=["pdcluster", "role", "worker", "placement", "reason"])
        for placement, reason, per_s in (("aggregated", "prefill_backlog", AGG_RATE),  # the load rule's
                                         ("aggregated", "short_prompt", 1.0),  # not the load rule's
                                         ("disaggregated", "prompt_length", RATE - 1.0 - AGG_RATE)):
            pl.add_metric(["demo", "router", "r0", placement, reason], per_s * t, timestamp=now)
        yield pl
        g = GaugeMetricFamily("pdcluster_requests_waiting", "queue", labels=["pdcluster", "role", "worker"])
        for w in ("p0", "p1"):
            g.add_metric(["demo", "prefill", w], 3, timestamp=now)  # the prefill queue never empties: saturated
        for w in ("d0", "d1"):
            g.add_metric(["demo", "decode", w], 0, timestamp=now)
        yield g
        yield from vllm_series(t, now)


def vllm_series(t: float, now: float):
    """PDCluster `vdemo` with `engine: vllm`: our router's series (in Workload's families), and vLLM's own from 2
    prefill + 2 decode workers (`pdcluster` and `role` as the PodMonitor relabels them from the pod labels). No router TTFT here:
    the quantile falls back to vLLM's histogram."""
    labels = ["pdcluster", "role", "worker"]
    n = RATE * t
    for name, samples in (
            ("vllm:prompt_tokens", [(["vdemo", "prefill", w], n * IN / 2) for w in ("p0", "p1")]),
            ("vllm:generation_tokens", [(["vdemo", "decode", w], n * OUT / 2) for w in ("d0", "d1")]),
            ("vllm:prefix_cache_hits", [(["vdemo", "prefill", w], HIT * n * IN / 2) for w in ("p0", "p1")]),
            # NIXL reads happen on the decode side: 1 in 20 fails
            ("vllm:nixl_num_failed_transfers", [(["vdemo", "decode", w], 0.05 * n / 2) for w in ("d0", "d1")])):
        c = CounterMetricFamily(name.removesuffix("_total"), name, labels=labels)
        for lv, v in samples:
            c.add_metric(lv, v, timestamp=now)
        yield c
    g = GaugeMetricFamily("vllm:num_requests_waiting", "queue", labels=labels)
    for w in ("p0", "p1"):
        g.add_metric(["vdemo", "prefill", w], 0, timestamp=now)
    for w in ("d0", "d1"):
        g.add_metric(["vdemo", "decode", w], 2, timestamp=now)  # decode's queue never empties: saturated
    yield g
    h = HistogramMetricFamily("vllm:time_to_first_token_seconds", "ttft", labels=labels)
    for w in ("d0", "d1"):
        h.add_metric(["vdemo", "decode", w], [(str(le), share * n / 2) for le, share in TTFT] + [("+Inf", n / 2)],
                     sum_value=n / 2, timestamp=now)
    yield h
    f = HistogramMetricFamily("vllm:request_generation_tokens", "finished lengths", labels=labels)
    for w in ("d0", "d1"):
        f.add_metric(["vdemo", "decode", w], [("+Inf", FIN_RATE * t / 2)], sum_value=FIN_RATE * VLLM_FIN_OUT * t / 2,
                     timestamp=now)
    yield f
    x = HistogramMetricFamily("vllm:nixl_xfer_time_seconds", "nixl", labels=labels)
    for w in ("d0", "d1"):
        x.add_metric(["vdemo", "decode", w], [("+Inf", 0.95 * n / 2)], sum_value=0.01 * n, timestamp=now)
    yield x


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Workload())
    exporter_port = free_port()
    server, thread = start_http_server(exporter_port, addr="127.0.0.1", registry=registry)
    tmp: Path = tmp_path_factory.mktemp("prometheus")
    (tmp / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: pdcluster\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{exporter_port}']\n")
    port = free_port()
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=open(tmp / "prometheus.log", "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"prometheus did not start: {(tmp / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        server.shutdown()


WINDOW = 6


def ready_at(source: PrometheusSource, cluster: str = "demo") -> float:
    """A sample's time such that the window ending there also starts on a sample and holds one a second: rate()
    then needs no extrapolation to the window's edges, which it does only partly when a scrape lies more than
    about one interval from an edge (a loaded machine's late or missed scrape), and so under-reports. Observations
    read at that instant."""
    series = f'pdcluster_requests_total{{pdcluster="{cluster}",role="router"}}'
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        newest = source.scalar(f"max(timestamp({series}))")
        for at in [] if newest is None else [newest - k for k in range(30)]:
            start = source.scalar(f"max(timestamp({series}))", at - WINDOW)
            n = source.scalar(f"max(count_over_time({series}[{WINDOW}s]))", at)
            if start == at - WINDOW and n is not None and n >= WINDOW and \
                    source.scalar(f"max(timestamp({series}))", at) == at:
                return at
        time.sleep(0.5)
    raise AssertionError(f"Prometheus never held a {WINDOW} s window of one-second samples")


def _observe_when_ready(source: PrometheusSource, cluster: str = "demo") -> asc.Observation:
    return source.observe(cluster, window_seconds=WINDOW, at=ready_at(source, cluster))


def test_observation_from_a_real_prometheus(prometheus: str) -> None:
    o = _observe_when_ready(PrometheusSource(prometheus))
    assert o.request_rate == pytest.approx(RATE, rel=0.1)
    assert o.mean_input_tokens == pytest.approx(IN, rel=0.05)
    assert o.mean_output_tokens == pytest.approx(OUT, rel=0.05)
    # per instance: the pool's throughput over the 2 instances reporting a queue
    assert o.prefill_tokens_per_instance == pytest.approx(RATE * IN / 2, rel=0.1)
    assert o.decode_tokens_per_instance == pytest.approx(RATE * OUT / 2, rel=0.1)
    assert o.prefill_saturated is True
    assert o.decode_saturated is False
    assert o.prefill_queue_now == 6 and o.decode_queue_now == 0  # the sum over the pool's workers, now
    # KV transfers over every role of the PDCluster: 0.98 x 4 req/s saved, 0.02 x 4 failed (save or load)
    assert o.kv_transfers_per_second == pytest.approx(0.98 * RATE, rel=0.1)
    assert o.kv_transfer_failures_per_second == pytest.approx(0.02 * RATE, rel=0.1)


def test_decision_learns_the_saturated_pool_from_prometheus(prometheus: str) -> None:
    o = _observe_when_ready(PrometheusSource(prometheus))
    pol = asc.Policy(headroom=1.5, prefill_capacity=None, decode_capacity=2000.0)
    d = asc.decide(pol, asc.State(), o, asc.PoolView(2, 2), asc.PoolView(2, 2), now=0)
    # prefill was saturated at ~4096 tok/s per instance: that is its capacity now
    assert d.state.prefill.learned_capacity == pytest.approx(RATE * IN / 2, rel=0.1)
    assert d.prefill.capacity_source == "learned"
    # 1.5 * 4 req/s * 2048 / 4096 = 3 instances; decode 1.5 * 4 * 512 / 2000 = 1.54 -> 2
    assert d.prefill.recommended == 3 and d.decode.recommended == 2


def test_optional_observations_from_a_real_prometheus(prometheus: str) -> None:
    source = PrometheusSource(prometheus)
    at = ready_at(source)
    o = source.observe("demo", window_seconds=WINDOW, percentile=0.95, burst_seconds=2, at=at)
    assert o.prefix_hit_rate == pytest.approx(HIT, rel=0.05)
    # p95 falls in the (1, 5] bucket, halfway through its 10%: Prometheus interpolates to 3 s
    assert o.ttft_seconds == pytest.approx(3.0, rel=0.1)
    assert o.tpot_seconds is None  # no TPOT histogram exported: the guard for decode is skipped
    assert o.peak_request_rate == pytest.approx(RATE, rel=0.2)  # a steady rate: the peak is the mean
    assert o.decode_join_seconds == pytest.approx(JOIN, rel=0.02)  # rate of the sum over rate of the count
    # O by completion: the mean length of the requests that finished, from the router's histogram
    assert o.finished_output_tokens == pytest.approx(FIN_OUT, rel=0.02)
    # the prompts the router's load rule had decode workers prefill (its other placements not counted)
    assert o.load_aggregated_rate == pytest.approx(AGG_RATE, rel=0.05)
    # the prompt lengths' SCV from the router's buckets over the tail rule's longer range (bucket rates are in
    # the ratio of the counts): each bucket uniform between its bounds, E[x] 7782, E[x^2] 3.27e8
    want = histogram_scv(list(PROMPTS))
    assert want == pytest.approx(4.397, abs=0.001)
    assert o.prompt_length_scv == pytest.approx(want, rel=0.01)
    # without the SLO guard or a burst window, those queries are not asked
    o = source.observe("demo", window_seconds=WINDOW, at=at)
    assert o.ttft_seconds is None and o.peak_request_rate is None and o.prefix_hit_rate is not None


def test_the_load_rules_placements_are_read_under_the_routers_own_labels() -> None:
    from pdcluster.operator.promsource import ROUTER
    from pdcluster.worker.router import aggregate as agg

    want = f'pdcluster_router_placements_total{{placement="{agg.AGGREGATED}",reason="{agg.PREFILL_BACKLOG}"}}'
    assert ROUTER["load_aggregated"] == want


def test_missing_series_and_unreachable_server(prometheus: str) -> None:
    with pytest.raises(MetricsUnavailable) as e:
        PrometheusSource(prometheus).observe("nobody", window_seconds=WINDOW)
    assert e.value.reason == "SeriesMissing"
    with pytest.raises(MetricsUnavailable) as e:
        PrometheusSource(f"http://127.0.0.1:{free_port()}", timeout=2).observe("demo", window_seconds=10)
    assert e.value.reason == "PrometheusUnreachable"


def test_vllm_workers_read_through_the_same_contract(prometheus: str) -> None:
    """engine vllm: the same Observation from vLLM's series (router series first, vLLM's per worker)."""
    source = PrometheusSource(prometheus)
    at = ready_at(source, "vdemo")
    o = source.observe("vdemo", window_seconds=WINDOW, percentile=0.95, engine="vllm", at=at)
    assert o.request_rate == pytest.approx(RATE, rel=0.1)
    assert o.mean_input_tokens == pytest.approx(IN, rel=0.05) and o.mean_output_tokens == pytest.approx(OUT, rel=0.05)
    assert o.prefill_tokens_per_instance == pytest.approx(RATE * IN / 2, rel=0.1)
    assert o.decode_tokens_per_instance == pytest.approx(RATE * OUT / 2, rel=0.1)
    assert o.decode_saturated is True and o.prefill_saturated is False
    assert o.decode_queue_mean == pytest.approx(4.0)
    assert o.decode_queue_now == 4 and o.prefill_queue_now == 0  # vLLM's queue gauge, as for the mean
    # no router histogram of finished lengths here: vLLM's own, on the decode workers
    assert o.finished_output_tokens == pytest.approx(VLLM_FIN_OUT, rel=0.02)
    assert o.prefix_hit_rate == pytest.approx(HIT, rel=0.05)
    assert o.ttft_seconds == pytest.approx(3.0, rel=0.1)  # vLLM's histogram, the router having none here
    assert o.decode_join_seconds is None  # vLLM exports no join series: the term is left out
    assert o.kv_transfers_per_second == pytest.approx(0.95 * RATE, rel=0.1)  # KVTransferDegraded's inputs
    assert o.kv_transfer_failures_per_second == pytest.approx(0.05 * RATE, rel=0.1)
    # read as our engine, the same cluster has no worker series: nothing per instance is invented
    o = source.observe("vdemo", window_seconds=WINDOW)
    assert o.prefill_tokens_per_instance is None and o.decode_tokens_per_instance is None
