"""One request through router -> prefill -> KV transfer -> decode is one OpenTelemetry trace: the client's
`traceparent` is the root's parent, the router's /internal/* calls carry its context, and every phase is a span
under the right parent. In process (each role with its own in-memory exporter) and across processes (workers
started with `pdcluster serve --otlp-endpoint`, exporting OTLP/HTTP protobuf to a local receiver)."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ..otlp_sink import SpanRecord, from_sdk, otlp_sink
from .harness import SECRET, free_port, make_worker, serve

PROMPT = [(7 * i) % 400 + 3 for i in range(40)]  # long enough to span blocks; threshold 0 disaggregates it
TRACE_ID = secrets.token_hex(16)
CLIENT_SPAN = secrets.token_hex(8)


def _traced(role: str, exporter: object) -> object:
    from pdcluster.worker.api.tracing import Tracing

    return Tracing.build(role, exporter, batch=False)


def _router(prefill: list[str], decode: list[str], exporter: object) -> contextlib.AbstractContextManager[str]:
    from pdcluster.worker.router.app import RouterState, build_router_app
    from pdcluster.worker.router.options import RouterOptions
    from pdcluster.worker.router.pool import Pool

    state = RouterState(Pool(prefill_urls=prefill, decode_urls=decode, interval=0.2, secret=SECRET),
                        RouterOptions(max_queue_depth=0, disaggregation_threshold=0, request_timeout=60, max_retries=0))
    app = build_router_app(state)
    app.state.tracing = _traced("router", exporter)
    return serve(app)


def _wait_ready(router: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = httpx.get(f"{router}/cluster", timeout=5).json()
        if all(w["healthy"] for w in snap["prefill"] + snap["decode"]):
            return
        time.sleep(0.2)
    raise AssertionError(f"workers never became healthy: {snap}")


def _request(router: str, stream: bool) -> None:
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": stream}
    headers = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}
    r = httpx.post(f"{router}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert ("data: [DONE]" in r.text) if stream else r.json()["choices"][0]["finish_reason"] == "length"


def _complete(spans: list[SpanRecord]) -> bool:
    names = {(s.service, s.name) for s in spans}
    return {("pdcluster-router", "POST /v1/completions"), ("pdcluster-router", "decode"),
            ("pdcluster-prefill", "POST /internal/prefill"), ("pdcluster-prefill", "kv_transfer"),
            ("pdcluster-decode", "POST /internal/decode"), ("pdcluster-decode", "decode")} <= names


def check_trace(spans: list[SpanRecord]) -> None:
    """One trace, the client's; every span under the parent it belongs to."""
    assert spans, "no spans"
    assert {s.trace_id for s in spans} == {TRACE_ID}, sorted({(s.service, s.name, s.trace_id) for s in spans})

    def one(service: str, name: str) -> SpanRecord:
        found = [s for s in spans if s.service == f"pdcluster-{service}" and s.name == name]
        assert len(found) == 1, (service, name, [(s.service, s.name) for s in spans])
        return found[0]

    def children(parent: SpanRecord) -> set[str]:
        return {s.name for s in spans if s.parent_id == parent.span_id}

    root = one("router", "POST /v1/completions")
    assert root.kind == "SERVER" and root.parent_id == CLIENT_SPAN
    assert root.attributes["pdcluster.finish_reason"] == "length"
    assert root.attributes["gen_ai.usage.output_tokens"] == 5
    prefill = one("prefill", "POST /internal/prefill")
    reserve = one("decode", "POST /internal/reserve")
    decode = one("decode", "POST /internal/decode")
    tokenize = [s for s in spans if s.name == "POST /internal/tokenize"]
    for s in (prefill, reserve, decode, *tokenize):
        assert s.kind == "SERVER" and s.parent_id == root.span_id, s
    assert len(tokenize) == 1
    # the router's own phases, then each worker's
    assert {"router_queue", "kv_transfer", "decode_queue", "decode"} <= children(root)
    assert {"prefill_queue", "prefill_compute", "kv_transfer"} <= children(prefill)
    assert {"kv_wait", "decode"} <= children(decode)
    assert prefill.attributes["pdcluster.request_id"] == decode.attributes["pdcluster.request_id"]
    assert one("prefill", "kv_transfer").attributes["pdcluster.kv_transfer.bytes"] > 0
    # the journey in order (one clock: every process here runs on this machine)
    assert root.start_ns <= tokenize[0].start_ns <= reserve.start_ns <= prefill.start_ns <= decode.start_ns
    assert one("prefill", "prefill_queue").end_ns <= one("prefill", "prefill_compute").end_ns
    for s in spans:
        assert s.start_ns <= s.end_ns, s


@pytest.mark.slow
def test_one_trace_in_process(tiny_model_dir: Path) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporters = {role: InMemorySpanExporter() for role in ("router", "prefill", "decode")}
    with contextlib.ExitStack() as stack:
        urls: dict[str, str] = {}
        for role in ("prefill", "decode"):
            app, _ = make_worker(tiny_model_dir, role)
            app.state.tracing = _traced(role, exporters[role])
            urls[role] = stack.enter_context(serve(app))
        router = stack.enter_context(_router([urls["prefill"]], [urls["decode"]], exporters["router"]))
        _wait_ready(router)
        _request(router, stream=False)
        deadline = time.monotonic() + 60
        while True:  # a span ends just after its response's last byte: give the servers a moment
            spans = [from_sdk(s) for e in exporters.values() for s in e.get_finished_spans()]
            if _complete(spans) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    check_trace(spans)


@contextlib.contextmanager
def _worker_process(model: Path, role: str, endpoint: str, log: Path) -> Iterator[str]:
    port = free_port()
    env = dict(os.environ, PDCLUSTER_KV_SECRET=SECRET.decode(), OTEL_BSP_SCHEDULE_DELAY="100")
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    cmd = [sys.executable, "-m", "pdcluster", "serve", "--model", str(model), "--role", role, "--host", "127.0.0.1",
           "--port", str(port), "--threads", "1", "--served-model-name", "tiny", "--log-level", "warning",
           "--otlp-endpoint", endpoint]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "worker did not start: " + log.read_text()[-2000:]
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_one_trace_across_processes(tiny_model_dir: Path, tmp_path: Path) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    router_spans = InMemorySpanExporter()
    with otlp_sink() as (endpoint, sink), contextlib.ExitStack() as stack:
        prefill = stack.enter_context(_worker_process(tiny_model_dir, "prefill", endpoint, tmp_path / "p.log"))
        decode = stack.enter_context(_worker_process(tiny_model_dir, "decode", endpoint, tmp_path / "d.log"))
        router = stack.enter_context(_router([prefill], [decode], router_spans))
        _wait_ready(router)
        _request(router, stream=True)

        def spans_now() -> list[SpanRecord]:
            return [from_sdk(s) for s in router_spans.get_finished_spans()] + list(sink.spans)

        deadline = time.monotonic() + 20
        while not _complete(spans_now()) and time.monotonic() < deadline:
            time.sleep(0.1)
        spans = spans_now()
        assert sink.posts and set(sink.posts) == {"/v1/traces"}, sink.posts
    check_trace(spans)
