"""The `pdcluster_*` Prometheus series of a worker (and of the router, which reuses this class).

Names are the DESIGN.md contract: the autoscaler's PromQL and the dashboards depend on them, so
they live in one place. Every series carries `role` (prefill|decode|both|router) and, when the
process runs for a PDCluster, `pdcluster` (the CR's name).

Counters and histograms are fed by the request path. The engine-state gauges (queue lengths, KV
blocks, preemptions) are read from `engine.stats()` by a custom collector at scrape time, so they
are never stale and the hot path never touches them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# The `*_created` series double every counter and histogram for a timestamp nobody queries.
disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# TTFT spans fast CPU toy runs (ms) up to long prompts behind a queue (tens of s).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# TPOT is per token: interesting range is 1 ms .. ~1 s.
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
# Request phases: from a few ms (a queue that is empty) to minutes (a long decode).
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
# Prompt / generation lengths in tokens.
LENGTH_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# Every series name of the contract, for tests and for the router's reuse.
SERIES = (
    "pdcluster_requests_total",
    "pdcluster_prompt_tokens_total",
    "pdcluster_generation_tokens_total",
    "pdcluster_time_to_first_token_seconds",
    "pdcluster_time_per_output_token_seconds",
    "pdcluster_requests_waiting",
    "pdcluster_requests_running",
    "pdcluster_kv_cache_used_blocks",
    "pdcluster_kv_cache_usage_ratio",
    "pdcluster_preemptions_total",
    "pdcluster_kv_transfer_bytes_total",
    "pdcluster_kv_transfer_seconds",
    "pdcluster_kv_transfer_failures_total",
    "pdcluster_requests_rejected_total",
    "pdcluster_request_phase_seconds",
    "pdcluster_e2e_request_latency_seconds",
    "pdcluster_request_prompt_tokens",
    "pdcluster_request_generation_tokens",
    "pdcluster_request_success_total",
    "pdcluster_prefix_cache_query_tokens_total",
    "pdcluster_prefix_cache_hit_tokens_total",
    "pdcluster_build_info",
    "pdcluster_decode_join_seconds",
    "pdcluster_native_pool_calls_total",
    "pdcluster_native_pool_shared_calls_total",
    "pdcluster_native_pool_stalls_total",
    "pdcluster_native_kernel_loaded",
)
NATIVE_LOADED = "native_kernel_loaded:"  # engine.stats() keys: this prefix + a native module's name (async_engine)

# One request's journey, in order. The router sees router_queue, kv_transfer, decode_queue and decode; the
# worker that prefills sees prefill_queue (waiting for the engine) and prefill_compute (its prefill steps).
# TTFT = router_queue + prefill_queue + prefill_compute (the first token leaves as soon as prefill ends).
PHASES = ("router_queue", "prefill_queue", "prefill_compute", "kv_transfer", "decode_queue", "decode")
FINISH_REASONS = ("stop", "length", "abort", "error")

REJECT_REASONS = ("queue_full", "draining", "not_ready", "timeout", "invalid")

StatsFn = Callable[[], Mapping[str, Any]]


def _num(stats: Mapping[str, Any], *keys: str) -> float | None:
    """First numeric value among `keys` (the engine's spelling first, then older/test spellings)."""
    for k in keys:
        v = stats.get(k)
        if isinstance(v, int | float) and not isinstance(v, bool):
            return float(v)
    return None


def engine_gauges(s: Mapping[str, Any]) -> dict[str, float]:
    """engine.stats() -> the values behind the engine-state series (missing keys read as 0)."""
    used = _num(s, "kv_cache_used_blocks", "used_blocks") or 0.0
    total = _num(s, "kv_cache_total_blocks", "total_blocks") or 0.0
    ratio = _num(s, "kv_cache_usage_ratio")
    return {
        "waiting": _num(s, "requests_waiting", "waiting") or 0.0,
        "swapped": _num(s, "requests_swapped", "swapped") or 0.0,
        "running": _num(s, "requests_running", "running") or 0.0,
        "used_blocks": used,
        "total_blocks": total,
        "usage_ratio": ratio if ratio is not None else (used / total if total else 0.0),
        "preemptions": _num(s, "preemptions_total", "preemptions") or 0.0,
        "prefix_query_tokens": _num(s, "prefix_cache_query_tokens") or 0.0,
        "prefix_hit_tokens": _num(s, "prefix_cache_hit_tokens") or 0.0,
        "pool_calls": _num(s, "native_pool_calls") or 0.0,
        "pool_shared_calls": _num(s, "native_pool_shared_calls") or 0.0,
        "pool_stalls": _num(s, "native_pool_stalls") or 0.0,
    }


class _EngineStateCollector(Collector):
    """Reads engine.stats() at scrape time. Without a stats source it reports zeros."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.stats_fn: StatsFn | None = None

    def _stats(self) -> Mapping[str, Any]:
        if self.stats_fn is None:
            return {}
        try:
            return self.stats_fn() or {}
        except Exception:  # a scrape must never fail because the engine is busy or half-built
            log.exception("engine.stats() failed during a metrics scrape")
            return {}

    def describe(self) -> Iterable[Metric]:
        # Describing without calling stats() lets the registry check names at construction time.
        return self._families({})

    def collect(self) -> Iterable[Metric]:
        return self._families(self._stats())

    def _families(self, s: Mapping[str, Any]) -> list[Metric]:
        names, values = list(self.labels), list(self.labels.values())
        g = engine_gauges(s)
        out: list[Metric] = []
        for name, doc, value in (
            # swapped-out requests wait to be swapped back in: they are queue, not batch
            ("pdcluster_requests_waiting", "Requests queued in the engine (incl. swapped out).",
             g["waiting"] + g["swapped"]),
            ("pdcluster_requests_running", "Requests in the engine's running batch.", g["running"]),
            ("pdcluster_kv_cache_used_blocks", "Paged KV cache blocks in use.", g["used_blocks"]),
            ("pdcluster_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1).", g["usage_ratio"]),
        ):
            fam = GaugeMetricFamily(name, doc, labels=names)
            fam.add_metric(values, value)
            out.append(fam)
        c = CounterMetricFamily(
            "pdcluster_preemptions", "Requests preempted (swap or recompute) since start.", labels=names
        )
        c.add_metric(values, g["preemptions"])
        out.append(c)
        for name, doc, value in (
            ("pdcluster_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache.",
             g["prefix_query_tokens"]),
            ("pdcluster_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache (KV reused).",
             g["prefix_hit_tokens"]),
            # CPU workers: the native kernels' work-sharing pool. Stalls rising with shared calls falling mean
            # the node's cores are oversubscribed (kernel calls then run on one thread for a while).
            ("pdcluster_native_pool_calls", "Native CPU kernel calls through the work-sharing pool.",
             g["pool_calls"]),
            ("pdcluster_native_pool_shared_calls", "Native CPU kernel calls a helper thread shared.",
             g["pool_shared_calls"]),
            ("pdcluster_native_pool_stalls", "Shared calls that waited on a descheduled helper (each starts a "
             "stretch of calls on the calling thread alone).", g["pool_stalls"]),
        ):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            out.append(c)
        # one sample per native module the worker asked for; none on a worker that never did (GPU, router)
        fam = GaugeMetricFamily("pdcluster_native_kernel_loaded", "1: this native CPU kernel module runs; 0: "
                                "it could not load here and its (2-3x slower) torch path runs.",
                                labels=[*names, "kernel"])
        for key, value in sorted(s.items()):
            if key.startswith(NATIVE_LOADED) and isinstance(value, int | float):
                fam.add_metric([*values, key[len(NATIVE_LOADED):]], float(value))
        out.append(fam)
        return out


class WorkerMetrics:
    """All pdcluster_* series for one process, bound to its labels.

    `registry` defaults to a fresh one (not the global default) so several apps can live in one
    test process without duplicate-series errors. `stats_fn` feeds the engine-state series at
    scrape time with engine.stats()-style keys (requests_waiting, requests_running,
    requests_swapped, kv_cache_used_blocks, kv_cache_total_blocks, kv_cache_usage_ratio,
    preemptions_total); the router can pass its own queue lengths the same way.
    """

    def __init__(
        self,
        role: str,
        registry: CollectorRegistry | None = None,
        *,
        cluster: str | None = None,
        stats_fn: StatsFn | None = None,
        model_name: str | None = None,
        process: bool = True,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.role = role
        self._process = process
        self._build: tuple[str, Mapping[str, Any]] | None = None  # build_info's arguments, for with_role
        labels = {"role": role}
        if cluster:
            labels["pdcluster"] = cluster
        if model_name:
            labels["model_name"] = model_name
        self.labels = labels
        names = list(labels)
        reg = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, names + list(extra), registry=reg)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, names, buckets=buckets, registry=reg).labels(**labels)

        # prometheus_client appends `_total` to counter names; pass the stem.
        self._requests = counter("pdcluster_requests", "Requests accepted.").labels(**labels)
        self._prompt_tokens = counter("pdcluster_prompt_tokens", "Prompt tokens processed.").labels(**labels)
        self._gen_tokens = counter("pdcluster_generation_tokens", "Tokens generated.").labels(**labels)
        self._rejected = counter(
            "pdcluster_requests_rejected", "Requests refused, by reason.",
            ("reason",),
        )
        for reason in REJECT_REASONS:  # zero series exist from the start, so rate() works at once
            self._rejected.labels(**labels, reason=reason)
        self._ttft = hist("pdcluster_time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self._tpot = hist(
            "pdcluster_time_per_output_token_seconds", "Time per output token after the first.", TPOT_BUCKETS
        )
        self._kv_bytes = counter("pdcluster_kv_transfer_bytes", "KV cache bytes transferred.").labels(**labels)
        self._kv_seconds = hist("pdcluster_kv_transfer_seconds", "Duration of one KV transfer.", TRANSFER_BUCKETS)
        self._kv_failures = counter("pdcluster_kv_transfer_failures", "Failed KV transfers.").labels(**labels)
        # The decode pool's per-request cost that O/C_d leaves out (the planner's t_join): import, scheduling
        # and the first step of a transferred request, from its KV being complete to its first output.
        self._join = hist("pdcluster_decode_join_seconds",
                          "Decode: seconds from a transferred request's KV being complete to its first output.",
                          TRANSFER_BUCKETS)
        self._phase = Histogram("pdcluster_request_phase_seconds",
                                "Time one request spent in each phase (see PHASES), observed where it is known.",
                                names + ["phase"], buckets=PHASE_BUCKETS, registry=reg)
        self._e2e = hist("pdcluster_e2e_request_latency_seconds", "Arrival to last token.", PHASE_BUCKETS)
        self._prompt_len = hist("pdcluster_request_prompt_tokens", "Prompt length of finished requests.",
                                LENGTH_BUCKETS)
        self._gen_len = hist("pdcluster_request_generation_tokens", "Tokens generated per finished request.",
                             LENGTH_BUCKETS)
        self._success = counter("pdcluster_request_success", "Requests finished, by finish reason.",
                                ("finish_reason",))
        for reason in FINISH_REASONS:
            self._success.labels(**labels, finish_reason=reason)
        self._info = Gauge("pdcluster_build_info", "Always 1: version and configuration in the labels.",
                           names + ["version", "key", "value"], registry=reg)
        self._engine_state = _EngineStateCollector(labels)
        reg.register(self._engine_state)
        if process:  # process_* (CPU, RSS, open fds) and python_info, as every Prometheus exporter has them
            ProcessCollector(registry=reg)
            PlatformCollector(registry=reg)
        if stats_fn is not None:
            self.bind_stats(stats_fn)
        if role in ("prefill", "decode", "both"):  # model servers, for a GIE / llm-d endpoint picker
            from pdcluster.worker.api.gie_metrics import GIECollector

            reg.register(GIECollector(self._engine_state._stats, model_name))

    # ------------------------------------------------------------------ feeding
    def bind_stats(self, stats_fn: StatsFn) -> None:
        """Use `stats_fn` (e.g. engine.stats) for the engine-state gauges at scrape time."""
        self._engine_state.stats_fn = stats_fn

    def request_accepted(self, prompt_tokens: int) -> None:
        self._requests.inc()
        self._prompt_tokens.inc(prompt_tokens)

    def tokens_generated(self, n: int) -> None:
        if n > 0:
            self._gen_tokens.inc(n)

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(max(0.0, seconds))

    def observe_tpot(self, seconds: float) -> None:
        self._tpot.observe(max(0.0, seconds))

    def rejected(self, reason: str) -> None:
        self._rejected.labels(**self.labels, reason=reason).inc()

    def kv_transfer(self, nbytes: int, seconds: float) -> None:
        self._kv_bytes.inc(nbytes)
        self._kv_seconds.observe(max(0.0, seconds))

    def decode_joined(self, seconds: float) -> None:
        """A transferred request's first output on the decode worker, `seconds` after its KV was complete."""
        self._join.observe(max(0.0, seconds))

    def kv_transfer_failed(self) -> None:
        self._kv_failures.inc()

    def phase(self, name: str, seconds: float) -> None:
        """One request spent `seconds` in phase `name` (one of PHASES)."""
        self._phase.labels(**self.labels, phase=name).observe(max(0.0, seconds))

    def request_finished(self, finish_reason: str | None, prompt_tokens: int, generation_tokens: int,
                         e2e_seconds: float | None = None) -> None:
        """A request ended: its finish reason, lengths and (where arrival is known) end-to-end latency."""
        reason = finish_reason if finish_reason in FINISH_REASONS else "abort"
        self._success.labels(**self.labels, finish_reason=reason).inc()
        self._prompt_len.observe(max(0, prompt_tokens))
        self._gen_len.observe(max(0, generation_tokens))
        if e2e_seconds is not None:
            self._e2e.observe(max(0.0, e2e_seconds))

    def build_info(self, version: str, config: Mapping[str, Any]) -> None:
        """pdcluster_build_info{version, key, value} = 1, one series per configuration setting (a label per
        setting would make the series' label set differ between roles and versions)."""
        self._build = (version, dict(config))
        self._info.labels(**self.labels, version=version, key="", value="").set(1)
        for k, v in sorted(config.items()):
            self._info.labels(**self.labels, version=version, key=str(k), value=str(v)[:200]).set(1)

    def with_role(self, role: str) -> WorkerMetrics:
        """A fresh set of series for the same process under another `role` (a role flip): every series
        carries the role, and one label set per process keeps the pool's sums right, so the old role's series
        end here and the new role's start from zero (Prometheus sees new series, not counter resets)."""
        m = WorkerMetrics(role, cluster=self.labels.get("pdcluster"), model_name=self.labels.get("model_name"),
                          process=self._process)
        if self._engine_state.stats_fn is not None:
            m.bind_stats(self._engine_state.stats_fn)
        if self._build is not None:
            version, config = self._build
            m.build_info(version, {**config, "role": role} if "role" in config else config)
        return m

    # ------------------------------------------------------------------ export
    def render(self) -> bytes:
        return generate_latest(self.registry)
