"""The preStop drain of vLLM pods (render_vllm.DRAIN_SCRIPT), run as the kubelet runs it, against a real HTTP
server serving vLLM-shaped /metrics: it waits while requests or KV blocks are held, returns 0 once the engine
reads idle twice in a row, and 1 when it gives up (the limit, or a server that stopped answering)."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pdcluster.operator import render_vllm
from pdcluster.operator.models import parse_spec

from ..netutil import free_port

BUSY = ('vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
        'vllm_kv_cache_usage_perc{engine="0",model_name="m"} 0.125\n')  # KV held for a decode pod's read
IDLE = BUSY.replace("0.125", "0.0") + 'vllm:num_requests_waiting_by_reason{reason="capacity"} 3.0\n'


class Metrics:
    """Serves BUSY for the first `busy` scrapes, IDLE after (busy=None: BUSY forever)."""

    def __init__(self, busy: int | None) -> None:
        self.busy, self.scrapes = busy, 0


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, Metrics]]:
    state = Metrics(request.param)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            state.scrapes += 1
            idle = state.busy is not None and state.scrapes > state.busy
            body = (IDLE if idle else BUSY).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    port = free_port()
    httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{port}/metrics", state
    finally:
        httpd.shutdown()


def _drain(url: str, limit: float) -> int:
    return subprocess.run([sys.executable, "-c", render_vllm.DRAIN_SCRIPT, str(limit), url], timeout=120).returncode


@pytest.mark.parametrize("server", [2], indirect=True)
def test_waits_while_kv_is_held_then_returns_drained(server: tuple[str, Metrics]) -> None:
    url, state = server
    assert _drain(url, 60) == 0
    assert state.scrapes == 4  # two busy reads, then two idle ones in a row


@pytest.mark.parametrize("server", [None], indirect=True)
def test_gives_up_at_its_limit(server: tuple[str, Metrics]) -> None:
    url, state = server
    assert _drain(url, 2) == 1 and state.scrapes >= 1


def test_a_server_that_is_gone_ends_the_wait() -> None:
    assert _drain(f"http://127.0.0.1:{free_port()}/metrics", 60) == 1


def test_the_pods_run_it_before_sigterm_within_their_grace_period() -> None:
    spec = parse_spec({"model": {"name": "m", "uri": "/m"}, "engine": "vllm", "kvTransfer": {"integrity": "fabric"},
                       "router": {"requestTimeoutSeconds": 100}})
    cmd = render_vllm.drain_command(spec)
    assert cmd[:3] == ["python3", "-c", render_vllm.DRAIN_SCRIPT] and cmd[4] == "http://127.0.0.1:8000/metrics"
    assert int(cmd[3]) == 120 < 130  # the grace period: the request timeout + 30 s
