"""Unbounded inputs (issue 15 items 3 and 7): prompt size capped in characters before tokenizing, tokenizing
off the event loop (health keeps answering), body and header read timeouts, a connection limit."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from pdcluster.worker.server.app import build_app

from .fake_engine import CharTokenizer, FakeEngine
from .harness import free_port, serve
from .test_bad_input import assert_openai_400


class SlowTokenizer(CharTokenizer):
    """Blocks the calling thread like a real tokenizer on a huge prompt; counts its calls."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.calls = seconds, 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        time.sleep(self.seconds)
        return super().encode(text, add_special_tokens)


@pytest.fixture(scope="module")
def slow() -> Iterator[tuple[str, SlowTokenizer]]:
    tok = SlowTokenizer(1.5)
    app = build_app(FakeEngine(tokenizer=tok, max_model_len=64), served_model_name="fake", request_timeout=30)
    with serve(app) as url:
        yield url, tok


def test_health_answers_while_a_prompt_is_tokenized(slow: tuple[str, SlowTokenizer]) -> None:
    url, _ = slow
    result: dict[str, Any] = {}

    def post() -> None:
        result["r"] = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 1}, timeout=30)

    t = threading.Thread(target=post)
    t.start()
    time.sleep(0.3)  # the request is inside encode() now
    t0 = time.monotonic()
    h = httpx.get(f"{url}/health", timeout=30)
    waited = time.monotonic() - t0
    t.join()
    assert h.status_code == 200 and waited < 0.8, f"/health took {waited:.2f} s while a prompt was tokenized"
    assert result["r"].status_code == 200


def test_prompt_over_the_character_cap_is_refused_before_tokenizing(slow: tuple[str, SlowTokenizer]) -> None:
    url, tok = slow
    before = tok.calls
    for path, body in (("/v1/completions", {"prompt": "x" * 200_000}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 200_000}]})):
        r = httpx.post(f"{url}{path}", json=body, timeout=30)
        assert_openai_400(r)
        assert r.json()["error"]["param"] in ("prompt", "messages") and "characters" in r.json()["error"]["message"]
    assert tok.calls == before, "the tokenizer ran on a prompt that could never fit"


# ---------------------------------------------------------------- slow clients (slowloris)


@pytest.fixture(scope="module")
def strict_server() -> Iterator[tuple[str, int]]:
    """The worker app under the same uvicorn options `pdcluster serve` uses, with short timeouts."""
    from pdcluster.worker.api.http_limits import uvicorn_options

    app = build_app(FakeEngine(), served_model_name="fake", request_timeout=30, body_timeout=1.0)
    port = free_port()
    opts = uvicorn_options(limit_concurrency=8, header_timeout=1.0, keep_alive=1)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **opts))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", port
    server.should_exit = True
    thread.join(timeout=10)


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    sock.settimeout(seconds)
    got = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return True, got
            got += chunk
    except TimeoutError:
        return False, got
    except ConnectionResetError:
        return True, got


def test_a_client_dribbling_headers_is_cut_off(strict_server: tuple[str, int]) -> None:
    _, port = strict_server
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        for _ in range(3):  # a header every 0.5 s never completes the head
            time.sleep(0.5)
            try:
                s.sendall(b"X-Slow: 1\r\n")
            except OSError:
                break
        closed, _ = _closed_within(s, 2.0)
    assert closed, "the server kept a connection whose headers never completed"


def test_a_client_dribbling_the_body_gets_408(strict_server: tuple[str, int]) -> None:
    _, port = strict_server
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        closed, got = _closed_within(s, 4.0)
    assert got.startswith(b"HTTP/1.1 408"), got[:200]


def test_connections_beyond_the_limit_get_503(strict_server: tuple[str, int]) -> None:
    url, port = strict_server
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
    try:
        r = httpx.get(f"{url}/health", timeout=5)
        assert r.status_code == 503
    finally:
        for s in idle:
            s.close()
    time.sleep(0.2)
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200


def test_worker_body_cap_holds_for_chunked_bodies(client: httpx.Client) -> None:
    from pdcluster.worker.api.body import MAX_BODY_BYTES

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // (1 << 20) + 2):
            yield b"a" * (1 << 20)
        yield b'"}'

    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
