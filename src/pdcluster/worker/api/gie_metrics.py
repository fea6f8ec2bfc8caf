"""Our workers' engine state under the names the Gateway API Inference Extension's endpoint picker (EPP) reads
by default, so an llm-d / GIE gateway can schedule onto pdcluster pods as onto vLLM pods (pods carry
`llm-d.ai/role: prefill|decode`).

The GIE model-server protocol asks for the semantics, not the names: a queue gauge, a running gauge, the
KV-cache use as a fraction, and the KV block size for prefix-aware picking. Its EPP's defaults are vLLM's
series, so these are exported as such beside the `pdcluster_*` ones they duplicate; an EPP configured with
other metric names can read `pdcluster_requests_waiting`, `pdcluster_requests_running` and
`pdcluster_kv_cache_usage_ratio` instead (docs/vllm.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

QUEUED = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_INFO = "vllm:cache_config_info"


class GIECollector(Collector):
    """Reads the same engine stats as the pdcluster_* engine-state series, at scrape time."""

    def __init__(self, stats: Callable[[], Mapping[str, Any]], model_name: str | None) -> None:
        self.stats, self.model_name = stats, model_name or ""

    def describe(self) -> Iterable[Metric]:
        return self._families({})

    def collect(self) -> Iterable[Metric]:
        return self._families(self.stats())

    def _families(self, s: Mapping[str, Any]) -> list[Metric]:
        from pdcluster.worker.api.metrics import engine_gauges

        g = engine_gauges(s)
        out: list[Metric] = []
        for name, doc, value in (
            (QUEUED, "Requests queued in the engine (GIE TotalQueuedRequests).", g["waiting"] + g["swapped"]),
            (RUNNING, "Requests in the engine's running batch (GIE TotalRunningRequests).", g["running"]),
            (KV_USAGE, "Fraction of KV cache blocks in use, 0..1 (GIE KVCacheUtilization).", g["usage_ratio"]),
        ):
            fam = GaugeMetricFamily(name, doc, labels=["model_name"])
            fam.add_metric([self.model_name], value)
            out.append(fam)
        info = GaugeMetricFamily(CACHE_INFO, "KV cache layout (GIE BlockSize, NumGPUBlocks).",
                                 labels=["block_size", "num_gpu_blocks"])
        info.add_metric([str(int(s.get("kv_cache_block_size") or 0)), str(int(g["total_blocks"]))], 1.0)
        out.append(info)
        return out
