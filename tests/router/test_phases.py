"""The router's share of the per-request phase breakdown: router queue, KV transfer, decode queue, decode and
end to end observed once per request (a retry does not observe a phase twice), with the finish reason."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pdcluster.worker.api.metrics import WorkerMetrics
from pdcluster.worker.router.flow import Tokenized

from .fakes import DECODE, PREFILL, Lines, Script, make_flow, ndjson, tokens


def counts(m: WorkerMetrics) -> dict[tuple[str, str], float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            if s.name in ("pdcluster_request_phase_seconds_count", "pdcluster_request_success_total",
                          "pdcluster_e2e_request_latency_seconds_count"):
                out[(s.name, s.labels.get("phase") or s.labels.get("finish_reason") or "")] = s.value
    return out


def test_disaggregated_request_observes_each_router_phase_once() -> None:
    async def go() -> dict[tuple[str, str], float]:
        script = Script()

        async def reserve(_: httpx.Request, __: dict[str, Any]) -> httpx.Response:
            return httpx.Response(200, json={"transfer_port": 9})

        async def prefill(_: httpx.Request, __: dict[str, Any]) -> httpx.Response:
            return httpx.Response(200, content=ndjson(
                {"event": "first_token", "token_id": 10, "text": "", "finished": False},
                {"event": "transferred", "seconds": 0.01, "bytes": 1}))

        async def decode(_: httpx.Request, __: dict[str, Any]) -> httpx.Response:
            return httpx.Response(200, stream=Lines(tokens(11, 3)))

        script.on(DECODE, "/internal/reserve", reserve)
        script.on(PREFILL, "/internal/prefill", prefill)
        script.on(DECODE, "/internal/decode", decode)
        flow = make_flow(script, threshold=1)
        flow.metrics = WorkerMetrics("router", CollectorRegistry(), process=False)
        out = [c async for c in flow.run("r", Tokenized([1, 2, 3, 4], {"max_tokens": 4}, "tiny"))]
        assert out[-1].finished
        await flow.close()
        return counts(flow.metrics)

    c = asyncio.run(go())
    for phase in ("router_queue", "kv_transfer", "decode_queue", "decode"):
        assert c[("pdcluster_request_phase_seconds_count", phase)] == 1, phase
    assert ("pdcluster_request_phase_seconds_count", "prefill_queue") not in c  # the prefill worker's to observe
    assert c[("pdcluster_e2e_request_latency_seconds_count", "")] == 1
    assert c[("pdcluster_request_success_total", "length")] == 1
