"""OpenTelemetry traces of each request's phases: router -> prefill -> KV transfer -> decode, one trace per request.

Off unless an OTLP endpoint is configured (`--otlp-endpoint`, or the standard OTEL_EXPORTER_OTLP_ENDPOINT /
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT): then OpenTelemetry is not even imported and every hook is a method call
on NO_SPAN that does nothing. On, each process exports its spans in batches over OTLP/HTTP (protobuf) under a
service name per role (pdcluster-router, pdcluster-prefill, pdcluster-decode, pdcluster-both).

One request's trace (W3C `traceparent` links the processes):
  router   POST /v1/chat/completions  SERVER, child of the client's `traceparent` when it sent one
    router   router_queue, kv_transfer, decode_queue, decode          phase spans (router/flow.py Timeline)
    prefill  POST /internal/prefill   SERVER: the router's /internal/* calls carry the request span's context
      prefill  prefill_queue, prefill_compute, kv_transfer
    decode   POST /internal/reserve, POST /internal/decode (or /internal/generate)
      decode   kv_wait, decode (and prefill_queue, prefill_compute on /internal/generate)
A phase span is recorded when its phase ends, from the same measurement that feeds the
pdcluster_request_phase_seconds histogram (`observed()` wraps the metrics so one call feeds both).

Torch-free: the router imports this module.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Mapping, MutableMapping
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

SPAN_KEY = "pdcluster.span"  # the ASGI scope key that holds a request's server span
TRACES_PATH = "/v1/traces"
ROLES = ("router", "prefill", "decode", "both")
Attrs = Mapping[str, str | int | float | bool]

# Span names for the POST routes; anything else is one name, so a client cannot mint names by the million.
_NAMED_PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/drain", "/undrain")


# ---------------------------------------------------------------------------------------------- configuration
def traces_url(base: str) -> str:
    """The OTLP/HTTP traces URL for a collector's base URL (as OTEL_EXPORTER_OTLP_ENDPOINT takes it):
    http://collector:4318 -> http://collector:4318/v1/traces; a URL already ending in /v1/traces is kept."""
    parts = urlsplit(base.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"OTLP endpoint {base!r} is not an http(s)://host[:port] URL")
    try:
        parts.port  # noqa: B018  (raises on a bad port)
    except ValueError:
        raise ValueError(f"OTLP endpoint {base!r} has an invalid port") from None
    url = base.strip().rstrip("/")
    return url if url.endswith(TRACES_PATH) else url + TRACES_PATH


def resolve_endpoint(flag: str | None, env: Mapping[str, str]) -> str | None:
    """Where spans go, or None for no tracing: the flag, else the OpenTelemetry environment variables
    (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is used as is, as the spec says; OTEL_EXPORTER_OTLP_ENDPOINT gets
    /v1/traces). OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none turn the environment's endpoint off."""
    if flag:
        return traces_url(flag)
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    if v := env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip():
        traces_url(v)  # validated the same way; used as given
        return v
    if v := env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
        return traces_url(v)
    return None


def otlp_endpoint(text: str) -> str:
    """argparse type of --otlp-endpoint: one clear `error: argument --otlp-endpoint: ...` line when bad."""
    try:
        traces_url(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_argument(parser: argparse.ArgumentParser | Any) -> None:
    parser.add_argument(
        "--otlp-endpoint", type=otlp_endpoint, default=None, metavar="URL",
        help="export request-phase traces over OTLP/HTTP to this collector (http://host:4318; /v1/traces is "
             "added); else $OTEL_EXPORTER_OTLP_ENDPOINT; default: no tracing")


def span_name(method: str, path: str) -> str:
    if path.startswith("/internal/") or path in _NAMED_PATHS:
        return f"{method} {path[:64]}"
    return f"{method} (other)"


# ---------------------------------------------------------------------------------------------- spans
class Span:
    """One request's span. This base class is the off state (NO_SPAN): every method does nothing."""

    enabled = False
    headers: Mapping[str, str] = {}  # the W3C trace context to send on calls made for this request

    def phase(self, name: str, seconds: float, attrs: Attrs | None = None) -> None:
        """A finished child span for a phase that just ended after `seconds`."""

    def set(self, attrs: Attrs) -> None:
        pass

    def event(self, name: str, attrs: Attrs | None = None) -> None:
        pass

    def status(self, code: int) -> None:
        pass

    def end(self, error: BaseException | None = None) -> None:
        pass


NO_SPAN = Span()


class _LiveSpan(Span):
    enabled = True

    def __init__(self, tracer: Any, span: Any) -> None:
        from opentelemetry import trace

        self._tracer, self._span = tracer, span
        self._ctx = trace.set_span_in_context(span)
        carrier: dict[str, str] = {}
        _propagator().inject(carrier, context=self._ctx)
        self.headers = carrier  # computed once: every worker call of this request sends the same parent
        self._ended = False

    def phase(self, name: str, seconds: float, attrs: Attrs | None = None) -> None:
        end = time.time_ns()
        start = end - int(max(0.0, seconds) * 1e9)
        s = self._tracer.start_span(name, context=self._ctx, start_time=start,
                                    attributes={"pdcluster.phase": name, **(attrs or {})})
        s.end(end_time=end)

    def set(self, attrs: Attrs) -> None:
        self._span.set_attributes(dict(attrs))

    def event(self, name: str, attrs: Attrs | None = None) -> None:
        self._span.add_event(name, dict(attrs or {}))

    def status(self, code: int) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.set_attribute("http.response.status_code", code)
        if code >= 500:
            self._span.set_status(Status(StatusCode.ERROR, f"HTTP {code}"))

    def end(self, error: BaseException | None = None) -> None:
        if self._ended:  # a streamed response ends its span at its last byte, and again on the way out
            return
        self._ended = True
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self._span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:200]))
        self._span.end()


def _propagator() -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator()


# ---------------------------------------------------------------------------------------------- a process's tracer
class Tracing:
    """One process's (or, in tests, one app's) tracer. Off (`Tracing()`): every span is NO_SPAN."""

    def __init__(self, provider: Any = None) -> None:
        self.provider = provider
        self.enabled = provider is not None
        self._tracer = provider.get_tracer("pdcluster") if provider is not None else None

    @classmethod
    def build(cls, role: str, exporter: Any, *, batch: bool = True, cluster: str | None = None) -> Tracing:
        """A tracer whose spans go to `exporter` (the OTLP exporter; tests pass an in-memory one, batch=False)."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        from pdcluster import __version__

        attrs: dict[str, str] = {"service.name": f"pdcluster-{role}", "service.namespace": "pdcluster",
                                 "service.version": __version__, "pdcluster.role": role}
        if cluster:
            attrs["pdcluster.cluster"] = cluster
        # shutdown_on_exit: the provider flushes what is queued when the process exits (SIGTERM included)
        provider = TracerProvider(resource=Resource.create(attrs))
        provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        return cls(provider)

    def server_span(self, name: str, carrier: Mapping[str, str], attrs: Attrs | None = None) -> Span:
        """A SERVER span continuing the trace in `carrier`'s `traceparent` (a new trace when there is none)."""
        if self._tracer is None:
            return NO_SPAN
        from opentelemetry.trace import SpanKind

        ctx = _propagator().extract(carrier)
        return _LiveSpan(self._tracer, self._tracer.start_span(name, context=ctx, kind=SpanKind.SERVER,
                                                               attributes=dict(attrs or {})))

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


_process = Tracing()


def configure(role: str, flag: str | None = None, *, cluster: str | None = None,
              env: Mapping[str, str] | None = None) -> Tracing:
    """The process's tracer, from --otlp-endpoint or the environment (ValueError names a bad endpoint)."""
    global _process
    endpoint = resolve_endpoint(flag, os.environ if env is None else env)
    if endpoint is None:
        _process = Tracing()
        return _process
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    _process = Tracing.build(role, OTLPSpanExporter(endpoint=endpoint), cluster=cluster)
    log.info("tracing: exporting spans as pdcluster-%s to %s", role, endpoint)
    return _process


def current() -> Tracing:
    return _process


# ---------------------------------------------------------------------------------------------- HTTP hooks
def tracing_of(scope: Mapping[str, Any]) -> Tracing:
    """An app's own tracer (`app.state.tracing`, set by tests that run several roles in one process), else the
    process's."""
    state = getattr(scope.get("app"), "state", None)
    t = getattr(state, "tracing", None)
    return t if isinstance(t, Tracing) else _process


def span_of(request: Any) -> Span:
    """The server span of this request (NO_SPAN when tracing is off)."""
    span = request.scope.get(SPAN_KEY)
    return span if isinstance(span, Span) else NO_SPAN


def _carrier(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw if k.lower() in (b"traceparent", b"tracestate")}


class TraceMiddleware:
    """A SERVER span around every POST (the API and /internal/* calls; probes and scrapes are GETs and are not
    traced). A streamed response's span ends with its last byte, so it covers the whole stream."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        tracer = tracing_of(scope)
        if not tracer.enabled:
            await self.app(scope, receive, send)
            return
        path = str(scope.get("path", ""))
        span = tracer.server_span(span_name("POST", path), _carrier(scope.get("headers") or []),
                                  {"http.request.method": "POST", "url.path": path[:256]})
        scope[SPAN_KEY] = span

        async def traced_send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                span.status(int(message["status"]))
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                span.end()

        try:
            await self.app(scope, receive, traced_send)
        except BaseException as e:
            span.end(error=e)
            raise
        finally:
            span.end()


def install(app: Any) -> None:
    """Add the middleware (cheap when tracing is off: one attribute lookup per POST)."""
    app.add_middleware(TraceMiddleware)


# ---------------------------------------------------------------------------------------------- phase hook
class _Observed:
    """A request's metrics that also record its phases as spans of `span`; anything else goes to the metrics."""

    def __init__(self, metrics: Any, span: Span) -> None:
        self._metrics, self._span = metrics, span

    def phase(self, name: str, seconds: float) -> None:
        if self._metrics is not None:
            self._metrics.phase(name, seconds)
        self._span.phase(name, seconds)

    def kv_transfer(self, nbytes: int, seconds: float) -> None:
        if self._metrics is not None:
            self._metrics.kv_transfer(nbytes, seconds)
        self._span.phase("kv_transfer", seconds, {"pdcluster.kv_transfer.bytes": int(nbytes)})

    def request_finished(self, finish_reason: str | None, prompt_tokens: int, generation_tokens: int,
                         e2e_seconds: float | None = None) -> None:
        if self._metrics is not None:
            self._metrics.request_finished(finish_reason, prompt_tokens, generation_tokens, e2e_seconds)
        self._span.set({"pdcluster.finish_reason": finish_reason or "none",
                        "gen_ai.usage.input_tokens": int(prompt_tokens),
                        "gen_ai.usage.output_tokens": int(generation_tokens)})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._metrics, name)


def observed(metrics: Any, span: Span) -> Any:
    """`metrics` itself when tracing is off (no wrapper, no cost), else metrics that also emit phase spans."""
    return _Observed(metrics, span) if span.enabled else metrics
