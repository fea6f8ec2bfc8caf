"""api/tracing.py: where spans go (flag vs the OTEL_* environment), the middleware's server span (client
`traceparent` honoured, streamed responses covered to their last byte, only POSTs), phases recorded once for
both the histogram and the trace, and nothing at all when tracing is off."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdcluster.worker.api import tracing
from pdcluster.worker.api.tracing import NO_SPAN, Tracing, resolve_endpoint, span_name, traces_url

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.mark.parametrize(("flag", "env", "want"), [
    (None, {}, None),
    ("http://collector:4318", {}, "http://collector:4318/v1/traces"),
    ("http://collector:4318/", {}, "http://collector:4318/v1/traces"),
    ("https://c.example:443/v1/traces", {}, "https://c.example:443/v1/traces"),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4318"}, "http://otel:4318/v1/traces"),
    # the signal-specific variable is used as given (the OpenTelemetry spec), and wins over the generic one
    (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/custom", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://o:2"},
     "http://t:1/custom"),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4318", "OTEL_SDK_DISABLED": "true"}, None),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4318", "OTEL_TRACES_EXPORTER": "none"}, None),
    ("http://flag:4318", {"OTEL_SDK_DISABLED": "true"}, "http://flag:4318/v1/traces"),  # an explicit flag wins
])
def test_where_spans_go(flag: str | None, env: dict[str, str], want: str | None) -> None:
    assert resolve_endpoint(flag, env) == want


@pytest.mark.parametrize("bad", ["collector:4318", "ftp://c:1", "http://", "http://c:99999", "notaurl"])
def test_bad_endpoints_are_named(bad: str) -> None:
    with pytest.raises(ValueError, match="OTLP endpoint"):
        traces_url(bad)
    with pytest.raises(ValueError, match="OTLP endpoint"):
        resolve_endpoint(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": bad})


def test_span_names_are_bounded() -> None:
    assert span_name("POST", "/internal/prefill") == "POST /internal/prefill"
    assert span_name("POST", "/v1/chat/completions") == "POST /v1/chat/completions"
    assert span_name("POST", "/whatever/" + "x" * 500) == "POST (other)"


def test_flag_on_every_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    from pdcluster.worker.local import launcher
    from pdcluster.worker.router import cli as router_cli
    from pdcluster.worker.server import cli as serve_cli

    for add, extra in ((router_cli.add_arguments, []), (serve_cli.add_arguments, ["--model", "m"]),
                       (launcher.add_arguments, [])):
        p = argparse.ArgumentParser(prog="x")
        add(p)
        assert p.parse_args([*extra]).otlp_endpoint is None
        assert p.parse_args([*extra, "--otlp-endpoint", "http://c:4318"]).otlp_endpoint == "http://c:4318"
        with pytest.raises(SystemExit) as e:
            p.parse_args([*extra, "--otlp-endpoint", "c:4318"])
        assert e.value.code == 2
        assert "--otlp-endpoint" in capsys.readouterr().err
    # `pdcluster up` hands it to the router and every worker it starts
    args = argparse.ArgumentParser()
    launcher.add_arguments(args)
    a = args.parse_args(["--otlp-endpoint", "http://c:4318"])
    assert launcher.worker_cmd(a, Path("m"), "prefill", 9001)[-2:] == ["--otlp-endpoint", "http://c:4318"]
    assert "--otlp-endpoint" in launcher.router_cmd(a, [], ["http://d:1"])
    assert "--otlp-endpoint" not in launcher.worker_cmd(args.parse_args([]), Path("m"), "decode", 9002)


def test_router_refuses_a_bad_environment_endpoint(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from pdcluster.worker.router import cli as router_cli

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "collector-without-scheme:4318")
    p = argparse.ArgumentParser()
    router_cli.add_arguments(p)
    try:
        assert router_cli.run(p.parse_args(["--decode", "http://a:1"])) == 2
    finally:
        tracing.configure("router", None, env={})
    assert "OTLP endpoint" in capsys.readouterr().err


def test_configure_off_and_on() -> None:
    try:
        assert not tracing.configure("decode", None, env={}).enabled
        assert tracing.current() is not None and not tracing.current().enabled
        on = tracing.configure("prefill", "http://127.0.0.1:9", env={})
        assert on.enabled and tracing.current() is on
        resource = on.provider.resource.attributes
        assert resource["service.name"] == "pdcluster-prefill" and resource["pdcluster.role"] == "prefill"
    finally:
        tracing.current().shutdown()
        tracing.configure("router", None, env={})
    assert not tracing.current().enabled


# ------------------------------------------------------------------------------------- the middleware
class FakeMetrics:
    def __init__(self) -> None:
        self.phases: list[tuple[str, float]] = []

    def phase(self, name: str, seconds: float) -> None:
        self.phases.append((name, seconds))


def _app(t: Tracing | None, seen: dict[str, Any]) -> FastAPI:
    app = FastAPI()
    tracing.install(app)
    if t is not None:
        app.state.tracing = t

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        span = tracing.span_of(request)
        seen["span"], seen["headers"] = span, dict(span.headers)
        m = FakeMetrics()
        seen["metrics"], seen["observed"] = m, tracing.observed(m, span)

        async def body() -> AsyncIterator[bytes]:
            for i in range(3):
                await asyncio.sleep(0.02)
                seen["observed"].phase("decode", 0.01)
                seen["last_chunk_ns"] = time.time_ns()
                yield f"chunk {i}\n".encode()

        return StreamingResponse(body())

    @app.post("/boom")
    async def boom() -> JSONResponse:
        return JSONResponse({"error": {"message": "x"}}, status_code=503)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        seen["get_span"] = tracing.span_of(request)
        return JSONResponse({"ok": True})

    return app


async def _drive(app: FastAPI, headers: dict[str, str] | None = None) -> None:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post("/v1/completions", json={}, headers=headers or {})
        assert r.text == "chunk 0\nchunk 1\nchunk 2\n"
        assert (await c.post("/boom")).status_code == 503
        assert (await c.get("/health")).status_code == 200


async def test_server_span_continues_the_client_trace_and_covers_the_stream() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind, StatusCode

    exporter = InMemorySpanExporter()
    seen: dict[str, Any] = {}
    await _drive(_app(Tracing.build("router", exporter, batch=False), seen),
                 {"traceparent": f"00-{TRACE_ID}-{PARENT}-01"})
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"POST /v1/completions", "decode", "POST (other)"}  # the GET is not traced
    assert seen["get_span"] is NO_SPAN
    root = spans["POST /v1/completions"]
    assert root.kind == SpanKind.SERVER and f"{root.context.trace_id:032x}" == TRACE_ID
    assert f"{root.parent.span_id:016x}" == PARENT
    assert root.resource.attributes["service.name"] == "pdcluster-router"
    assert root.end_time >= seen["last_chunk_ns"]  # ended with the stream, not when the handler returned
    # what the router sends on its worker calls: this span as the parent, same trace
    assert seen["headers"]["traceparent"] == f"00-{TRACE_ID}-{root.context.span_id:016x}-01"
    # one call fed the histogram and the trace: three phases observed, three decode spans under the root
    decode = [s for s in exporter.get_finished_spans() if s.name == "decode"]
    assert len(decode) == 3 and seen["metrics"].phases == [("decode", 0.01)] * 3
    assert all(s.parent.span_id == root.context.span_id for s in decode)
    assert all(abs((s.end_time - s.start_time) - 10_000_000) < 1000 for s in decode)
    assert spans["POST (other)"].status.status_code == StatusCode.ERROR
    assert spans["POST (other)"].attributes["http.response.status_code"] == 503


async def test_no_traceparent_starts_a_new_trace() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    await _drive(_app(Tracing.build("decode", exporter, batch=False), {}))
    root = next(s for s in exporter.get_finished_spans() if s.name == "POST /v1/completions")
    assert root.parent is None and root.context.trace_id != 0


async def test_off_means_nothing_happens() -> None:
    seen: dict[str, Any] = {}
    await _drive(_app(None, seen))  # the process's tracer, off by default
    assert seen["span"] is NO_SPAN and seen["headers"] == {}
    assert seen["observed"] is seen["metrics"]  # no wrapper: the metrics object itself
    assert seen["metrics"].phases == [("decode", 0.01)] * 3
