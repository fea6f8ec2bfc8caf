"""A tiny OTLP/HTTP traces receiver on 127.0.0.1 for tests: worker processes export their spans to it (what a
Collector's otlp receiver does), and the test reads them back as plain dicts."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class SpanRecord:
    """One span, from whichever process, in the shape the assertions need."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]


def from_sdk(span: Any) -> SpanRecord:
    """An SDK ReadableSpan (the in-memory exporter's) as a SpanRecord."""
    ctx, parent = span.context, span.parent
    return SpanRecord(str(span.resource.attributes.get("service.name")), span.name, f"{ctx.trace_id:032x}",
                      f"{ctx.span_id:016x}", f"{parent.span_id:016x}" if parent else "", span.kind.name,
                      span.start_time, span.end_time, dict(span.attributes or {}))


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


def decode(body: bytes) -> list[SpanRecord]:
    """An ExportTraceServiceRequest (protobuf) as SpanRecords."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(SpanRecord(str(service), s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                      Span.SpanKind.Name(s.kind).removeprefix("SPAN_KIND_"), s.start_time_unix_nano,
                                      s.end_time_unix_nano, {a.key: _value(a.value) for a in s.attributes}))
    return out


class Sink:
    def __init__(self) -> None:
        self.spans: list[SpanRecord] = []
        self.posts: list[str] = []  # request paths, to check the exporter's URL
        self._lock = threading.Lock()

    def add(self, path: str, body: bytes) -> None:
        spans = decode(body)
        with self._lock:
            self.posts.append(path)
            self.spans.extend(spans)

    def wait_for(self, ok: Callable[[list[SpanRecord]], bool], timeout: float = 20.0) -> list[SpanRecord]:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            if ok(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)


@contextlib.contextmanager
def otlp_sink() -> Iterator[tuple[str, Sink]]:
    """(base URL, sink): an OTLP/HTTP receiver on a free loopback port, for the test's duration."""
    sink = Sink()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                sink.add(self.path, body)
                code = 200
            except Exception:  # a body that is not OTLP protobuf: the test will see no spans
                code = 400
            self.send_response(code)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", sink
    finally:
        server.shutdown()
        server.server_close()
