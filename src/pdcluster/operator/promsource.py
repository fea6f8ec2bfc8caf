"""The autoscaler's metrics source: PromQL over the workers' and router's `pdcluster_*` series (defined in
`worker/api/metrics.py`; docs/architecture.md) via prometheus-api-client.

All series are filtered by `pdcluster="<name>"` (in Kubernetes, Prometheus relabelling copies the pod
label `app.kubernetes.io/instance` into `pdcluster`). Over `window` seconds:

- λ  = sum(rate(pdcluster_requests_total{role="router"}))  (fallback: role="decode": every request
  ends on a decode worker)
- I  = rate(pdcluster_prompt_tokens_total) / λ, O = rate(pdcluster_generation_tokens_total) / λ
  (router series first, else prefill/decode workers)
- O by completion = rate(pdcluster_request_generation_tokens_sum) / rate(..._count): the mean length of the
  requests that finished in the window (router first, else decode workers; optional: the flip window's O,
  `autoscaler_flip_window.by_completion`)
- per-instance throughput: prompt tok/s of role="prefill" (output tok/s of role="decode") divided by the
  number of instances reporting `pdcluster_requests_waiting` for that role
- saturated: min over the window of sum(pdcluster_requests_waiting{role=...}) > 0, i.e. the queue never
  emptied.
- queue mean: avg over the window of sum(pdcluster_requests_waiting{role=...}) (the SLO guard grows a
  pool only when it had a queue to cure); queue now: the same sum at the end of the window (a backlog the
  last change did not cure)
- prefix hit rate = rate(pdcluster_prefix_cache_hit_tokens_total{role="prefill"}) / rate(prompt tokens of
  the prefill workers) (optional: missing on workers without the counter -> no discount)
- peak λ (with `burst_seconds`): max over the window of the `burst_seconds` request rate, a subquery
  `max_over_time(sum(rate(...[b]))[w:b/2])`; empty (scrape interval > b/2) -> the same at 3b (optional)
- t_join = the mean of `pdcluster_decode_join_seconds{role="decode"}` (rate of its sum / rate of its count:
  a transferred request's KV complete -> its first output) less the decode workers' mean step (the same of
  `pdcluster_time_per_output_token_seconds`): `autoscaler_rules.join_cost` (optional: missing on older
  workers, or no transfer in the window -> the formula without the term)
- load-aggregated rate = rate(pdcluster_router_placements_total{placement="aggregated",
  reason="prefill_backlog"}): prompts the router had decode workers prefill because the prefill queue missed
  its TTFT target (optional: decode's TPOT breach is then the valve's price, `autoscaler_guard.valve_explains`)
- prompt-length SCV = `autoscaler_tail.histogram_scv` of `sum by (le) (rate(pdcluster_request_prompt_tokens_bucket
  {role="router"}[r]))` over r = max(window, `autoscaler_tail.SCV_WINDOW_SECONDS`): the prefill tail need
  (optional: no finished request in the range -> no tail need)
- TTFT / TPOT at `percentile` (with the SLO guard on): `histogram_quantile(q, sum by (le)
  (rate(..._bucket[w])))` of the router's histograms, else the decode workers' (optional)

One contract, two engines (`engine`): the router's series are ours whatever the workers run, and the workers'
series are read under their engine's names (`SERIES`): for `vllm` the vLLM server's own (`vllm:prompt_tokens`,
`vllm:generation_tokens`, `vllm:num_requests_waiting`, `vllm:prefix_cache_hits`, TTFT and inter-token latency
histograms, NIXL transfers and their failures), relabelled with `pdcluster` and `role` from the pod labels
like ours. vLLM has no decode-join
series: its term is left out of the formula (docs/vllm.md).

The client is synchronous (requests); call `observe` from a thread.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from pdcluster.operator.autoscaler import Observation
from pdcluster.operator.autoscaler_rules import join_cost
from pdcluster.operator.autoscaler_tail import SCV_WINDOW_SECONDS, histogram_scv

log = logging.getLogger(__name__)


class MetricsUnavailable(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


# The workers' series the autoscaler reads, per engine (None: the engine exports no equivalent).
SERIES: dict[str, dict[str, str | None]] = {
    "pdcluster": {
        "requests": "pdcluster_requests_total",
        "prompt_tokens": "pdcluster_prompt_tokens_total",
        "generation_tokens": "pdcluster_generation_tokens_total",
        "finished_generation_tokens": "pdcluster_request_generation_tokens",  # histogram: _sum / _count
        "waiting": "pdcluster_requests_waiting",
        "prefix_hit_tokens": "pdcluster_prefix_cache_hit_tokens_total",
        "ttft": "pdcluster_time_to_first_token_seconds",
        "tpot": "pdcluster_time_per_output_token_seconds",
        "join": "pdcluster_decode_join_seconds",
        "kv_transfers": "pdcluster_kv_transfer_seconds_count",
        "kv_transfer_failures": "pdcluster_kv_transfer_failures_total",
        # the router's only: prompts it had a decode worker prefill because the prefill queue missed its target
        # (labels: worker/router/aggregate.py's AGGREGATED, PREFILL_BACKLOG; the operator does not import it)
        "load_aggregated": 'pdcluster_router_placements_total{placement="aggregated",reason="prefill_backlog"}',
        # the router's only: prompt lengths of finished requests (histogram), for their SCV (autoscaler_tail)
        "prompt_length": "pdcluster_request_prompt_tokens",
    },
    "vllm": {
        # vLLM names its series `vllm:...`; prometheus_client serves them as `vllm_...` to a scraper that
        # negotiates OpenMetrics without `escaping=allow-utf-8` (Prometheus 2.x): match either spelling.
        "requests": "vllm[:_]request_success_total",
        "prompt_tokens": "vllm[:_]prompt_tokens_total",
        "generation_tokens": "vllm[:_]generation_tokens_total",
        "finished_generation_tokens": "vllm[:_]request_generation_tokens",
        "waiting": "vllm[:_]num_requests_waiting",
        "prefix_hit_tokens": "vllm[:_]prefix_cache_hits_total",
        "ttft": "vllm[:_]time_to_first_token_seconds",
        "tpot": "vllm[:_]inter_token_latency_seconds",
        "join": None,
        # NIXL reads, counted on the decode side; failures include handshakes (KVTransferDegraded)
        "kv_transfers": "vllm[:_]nixl_xfer_time_seconds_count",
        "kv_transfer_failures": "vllm[:_]nixl_num_failed_transfers_total",
    },
}
# The router is ours with either engine.
ROUTER = SERIES["pdcluster"]


def _series(name: str | None, sel: str) -> str:
    """`name{labels}`, or for a name pattern (SERIES of vllm) `{__name__=~"pattern",labels}`; an entry with labels
    of its own (`name{a="b"}`) keeps them beside the selector's."""
    if name is not None and "[" in name:
        return '{__name__=~"' + name + '",' + sel[1:]
    if name is not None and "{" in name:
        base, own = name.rstrip("}").split("{", 1)
        return f"{base}{{{own},{sel[1:]}"
    return f"{name}{sel}"


def _sel(cluster: str, role: str) -> str:
    cluster = cluster.replace("\\", "\\\\").replace('"', '\\"')
    return f'{{pdcluster="{cluster}",role="{role}"}}'


def _sel_cluster(cluster: str) -> str:
    cluster = cluster.replace("\\", "\\\\").replace('"', '\\"')
    return f'{{pdcluster="{cluster}"}}'


class PrometheusSource:
    def __init__(self, url: str, *, timeout: float = 10.0, client: Any = None) -> None:
        self.url = url
        self.timeout = timeout
        self._client = client

    def _prom(self) -> Any:
        if self._client is None:
            from prometheus_api_client import PrometheusConnect
            from urllib3.util.retry import Retry

            # One quick retry: the autoscaler asks again next interval anyway.
            self._client = PrometheusConnect(url=self.url, disable_ssl=not self.url.startswith("https"),
                                             timeout=self.timeout,
                                             retry=Retry(total=1, backoff_factor=0.2,
                                                         status_forcelist=[502, 503, 504]))
        return self._client

    def _query(self, query: str, at: float | None) -> list[dict[str, Any]]:
        """The instant vector of `query` (at Unix time `at`, else now); MetricsUnavailable when Prometheus fails."""
        try:
            return self._prom().custom_query(query=query, params=None if at is None else {"time": at}) or []
        except Exception as e:  # requests errors, PrometheusApiClientException, bad JSON
            detail = str(e)
            # requests nests the root cause at the end: "... (Caused by NameResolutionError(...))"
            if "Caused by " in detail:
                detail = detail.split("Caused by ", 1)[1].split("(", 1)[0]
            raise MetricsUnavailable("PrometheusUnreachable",
                                     f"Prometheus at {self.url} did not answer: {type(e).__name__}: "
                                     f"{detail[:160]}") from e

    def scalar(self, query: str, at: float | None = None) -> float | None:
        """The value of a one-element instant vector (at Unix time `at`, else now); None when the vector is empty
        or NaN."""
        result = self._query(query, at)
        if not result:
            return None
        try:
            value = float(result[0]["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            return None
        return None if math.isnan(value) or math.isinf(value) else value

    def buckets(self, query: str, at: float | None = None) -> list[tuple[float, float]]:
        """A histogram's `(le, value)` pairs from a `sum by (le) (...)` query (empty when Prometheus has none)."""
        out = []
        for row in self._query(query, at):
            try:
                le, value = float(row["metric"]["le"]), float(row["value"][1])
            except (KeyError, IndexError, TypeError, ValueError):
                continue
            if not math.isnan(value):
                out.append((le, value))
        return out

    def _first(self, *queries: str, at: float | None = None) -> float | None:
        for q in queries:
            v = self.scalar(q, at)
            if v is not None:
                return v
        return None

    def observe(self, cluster: str, window_seconds: int, ready: dict[str, int] | None = None, *,
                percentile: float | None = None, burst_seconds: int = 0, engine: str = "pdcluster",
                at: float | None = None) -> Observation:
        # Every query of one observation reads the same instant: `at` (Unix time), else Prometheus's now.
        def scalar(query: str) -> float | None:
            return self.scalar(query, at)

        def first(*queries: str) -> float | None:
            return self._first(*queries, at=at)

        wk = SERIES[engine]  # the workers' names; the router's are ROUTER's
        w = f"{int(window_seconds)}s"
        step = f"{max(1, min(15, int(window_seconds) // 10))}s"
        router, prefill, decode = _sel(cluster, "router"), _sel(cluster, "prefill"), _sel(cluster, "decode")
        cl = _sel_cluster(cluster)  # every role: saves fail on prefill, loads on decode
        rate = first(
            f"sum(rate({_series(ROUTER['requests'], router)}[{w}]))",
            f"sum(rate({_series(wk['requests'], decode)}[{w}]))",
        )
        if rate is None:
            raise MetricsUnavailable(
                "SeriesMissing",
                f"no {ROUTER['requests']} (router) or {wk['requests']} (decode) series for pdcluster={cluster!r} "
                "in Prometheus",
            )
        prompt_rate = first(
            f"sum(rate({_series(ROUTER['prompt_tokens'], router)}[{w}]))",
            f"sum(rate({_series(wk['prompt_tokens'], prefill)}[{w}]))",
        )
        gen_rate = first(
            f"sum(rate({_series(ROUTER['generation_tokens'], router)}[{w}]))",
            f"sum(rate({_series(wk['generation_tokens'], decode)}[{w}]))",
        )
        if rate > 0 and (prompt_rate is None or gen_rate is None):
            raise MetricsUnavailable(
                "SeriesMissing",
                f"no prompt/generation token series for pdcluster={cluster!r} in Prometheus",
            )
        mean_in = prompt_rate / rate if rate > 0 and prompt_rate is not None else None
        mean_out = gen_rate / rate if rate > 0 and gen_rate is not None else None

        def per_instance(counter: str, sel: str, role: str) -> float | None:
            total = scalar(f"sum(rate({_series(counter, sel)}[{w}]))")
            n = scalar(f"count({_series(wk['waiting'], sel)})")
            if not n and ready:
                n = ready.get(role)
            if total is None or not n:
                return None
            return total / n

        def queue_mean(sel: str) -> float | None:
            return scalar(f"avg_over_time(sum({_series(wk['waiting'], sel)})[{w}:{step}])")

        def queue_now(sel: str) -> float | None:
            return scalar(f"sum({_series(wk['waiting'], sel)})")

        def saturated(sel: str) -> bool:
            v = scalar(f"min_over_time(sum({_series(wk['waiting'], sel)})[{w}:{step}])")
            return bool(v is not None and v > 0)

        prefix_hits = scalar(f"sum(rate({_series(wk['prefix_hit_tokens'], prefill)}[{w}]))")
        prefill_prompts = scalar(f"sum(rate({_series(wk['prompt_tokens'], prefill)}[{w}]))")
        hit_rate = (min(1.0, prefix_hits / prefill_prompts)
                    if prefix_hits is not None and prefill_prompts else None)
        peak = None
        # A scrape interval longer than half the burst window leaves rate() empty: then 3x the window.
        for bs in (int(burst_seconds), 3 * int(burst_seconds)):
            if peak is not None or not 0 < bs < window_seconds:
                continue
            b, sub = f"{bs}s", f"{max(1, bs // 2)}s"
            peak = first(
                f"max_over_time(sum(rate({_series(ROUTER['requests'], router)}[{b}]))[{w}:{sub}])",
                f"max_over_time(sum(rate({_series(wk['requests'], decode)}[{b}]))[{w}:{sub}])",
            )

        def finished_mean() -> float | None:
            for hist, sel in ((ROUTER["finished_generation_tokens"], router),
                              (wk["finished_generation_tokens"], decode)):
                count = scalar(f"sum(rate({_series(f'{hist}_count', sel)}[{w}]))")
                if count:
                    total = scalar(f"sum(rate({_series(f'{hist}_sum', sel)}[{w}]))")
                    return total / count if total is not None else None
            return None

        join = None
        if wk["join"] is not None:
            join_h, step_h = wk["join"], wk["tpot"]
            join_sum = scalar(f"sum(rate({_series(f'{join_h}_sum', decode)}[{w}]))")
            join_count = scalar(f"sum(rate({_series(f'{join_h}_count', decode)}[{w}]))")
            step_sum = scalar(f"sum(rate({_series(f'{step_h}_sum', decode)}[{w}]))")
            step_count = scalar(f"sum(rate({_series(f'{step_h}_count', decode)}[{w}]))")
            join = join_cost(join_sum / join_count if join_sum is not None and join_count else None,
                             step_sum / step_count if step_sum is not None and step_count else None)

        def quantile(kind: str) -> float | None:
            if percentile is None:
                return None
            return first(*(
                f"histogram_quantile({percentile:g}, sum by (le) (rate({_series(f'{hist}_bucket', sel)}[{w}])))"
                for hist, sel in ((ROUTER[kind], router), (wk[kind], decode)) if hist))

        return Observation(
            request_rate=rate,
            mean_input_tokens=mean_in,
            mean_output_tokens=mean_out,
            prefill_tokens_per_instance=per_instance(str(wk["prompt_tokens"]), prefill, "prefill"),
            decode_tokens_per_instance=per_instance(str(wk["generation_tokens"]), decode, "decode"),
            prefill_saturated=saturated(prefill),
            decode_saturated=saturated(decode),
            prefix_hit_rate=hit_rate,
            peak_request_rate=peak,
            ttft_seconds=quantile("ttft"),
            tpot_seconds=quantile("tpot"),
            finished_output_tokens=finished_mean(),
            prefill_queue_mean=queue_mean(prefill),
            decode_queue_mean=queue_mean(decode),
            decode_join_seconds=join,
            prefill_queue_now=queue_now(prefill),
            decode_queue_now=queue_now(decode),
            kv_transfers_per_second=scalar(f"sum(rate({_series(wk['kv_transfers'], cl)}[{w}]))"),
            kv_transfer_failures_per_second=scalar(f"sum(rate({_series(wk['kv_transfer_failures'], cl)}[{w}]))"),
            load_aggregated_rate=scalar(f"sum(rate({_series(ROUTER['load_aggregated'], router)}[{w}]))"),
            prompt_length_scv=histogram_scv(self.buckets(
                f"sum by (le) (rate({_series(str(ROUTER['prompt_length']) + '_bucket', router)}"
                f"[{int(max(window_seconds, SCV_WINDOW_SECONDS))}s]))", at)),
        )
