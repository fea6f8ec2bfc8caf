"""The router's HTTP face over real HTTP, in front of a fake-engine worker: body cap enforced while reading,
hostile JSON is a 400 naming the field (never a 500), the same request checks as on a worker, and the
internal bearer token only on `/internal/*` calls."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdcluster.worker.router.app import RouterState, build_router_app
from pdcluster.worker.router.options import RouterOptions
from pdcluster.worker.router.pool import Pool
from pdcluster.worker.server.app import build_app
from pdcluster.worker.server.internal_routes import Disaggregation
from pdcluster.worker.transfer.options import TransferOptions

from ..netutil import serve
from ..server.disagg_fake import DisaggFakeEngine
from ..server.test_bad_input import assert_openai_400
from ..server.test_hostile_input import RAW_CASES

SECRET = b"router-app-secret-0123456789abcdef"
TOKEN = hmac.new(SECRET, b"pdcluster-internal-v1", hashlib.sha256).hexdigest()
CAP = 1 << 20


def _worker_app(secret: bytes | None) -> FastAPI:
    engine = DisaggFakeEngine()
    d = Disaggregation(engine, role="decode", secret=secret, options=TransferOptions(backend="tcp"))
    return build_app(engine, role="decode", served_model_name="fake", routers=[d.router], on_startup=[d.start],
                     on_shutdown=[d.stop], request_timeout=30)


def _wait_healthy(url: str) -> None:
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "router never saw a healthy worker"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def router() -> Iterator[str]:
    with serve(_worker_app(SECRET)) as worker:
        state = RouterState(Pool(decode_urls=[worker], interval=0.2, secret=SECRET), RouterOptions(
            max_queue_depth=0, disaggregation_threshold=0, request_timeout=30, max_retries=1), max_body_bytes=CAP)
        with serve(build_router_app(state)) as url:
            _wait_healthy(url)
            yield url


def test_router_serves_a_valid_request(router: str) -> None:
    r = httpx.post(f"{router}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abc", r.text


@pytest.mark.parametrize("case", RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_hostile_json_through_the_router_is_400(router: str, case: tuple[str, str, str, str],
                                               caplog: pytest.LogCaptureFixture) -> None:
    _, raw, path, field = case
    with caplog.at_level(logging.WARNING):
        r = httpx.post(f"{router}{path}", content=raw.encode(), headers={"content-type": "application/json"},
                       timeout=30)
    assert_openai_400(r)
    if field:
        assert r.json()["error"]["param"] == field, r.text
    assert not [rec for rec in caplog.records if rec.exc_info], "bad input must not log a traceback"


@pytest.mark.parametrize("body", [
    {"prompt": "a", "stop_token_ids": [1000]},
    {"prompt": "a", "tools": [{"type": "function"}]},
    {"prompt": "a", "max_tokens": 0},
], ids=["stop ids out of vocab", "unimplemented field", "max_tokens 0"])
def test_same_checks_through_the_router(router: str, body: dict[str, Any]) -> None:
    assert_openai_400(httpx.post(f"{router}/v1/completions", json=body, timeout=30))


def test_router_body_cap_with_content_length_answers_before_the_body(router: str) -> None:
    host, port = router.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {100 * CAP}\r\n\r\n".encode() + b'{"prompt": "')
        s.settimeout(5)
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]


def test_router_body_cap_holds_for_chunked_bodies(router: str) -> None:
    sent = 0

    def chunks() -> Iterator[bytes]:
        nonlocal sent
        yield b'{"prompt": "'
        for _ in range(8):
            sent += 1
            yield b"a" * CAP
        yield b'"}'

    r = httpx.post(f"{router}/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text


@contextlib.contextmanager
def _router_over(worker_app: FastAPI) -> Iterator[str]:
    """A router over one decode worker served by `worker_app`, once it sees that worker healthy: its URL."""
    with serve(worker_app) as worker:
        state = RouterState(Pool(decode_urls=[worker], interval=0.2, secret=SECRET), RouterOptions(
            max_queue_depth=0, disaggregation_threshold=0, request_timeout=30, max_retries=1))
        with serve(build_router_app(state)) as url:
            _wait_healthy(url)
            yield url


def test_internal_token_only_on_internal_routes() -> None:
    seen: dict[str, list[str | None]] = {}
    spy = FastAPI()

    @spy.get("/internal/load")
    async def load(request: Request) -> JSONResponse:
        seen.setdefault("/internal/load", []).append(request.headers.get("authorization"))
        return JSONResponse({"ready": True, "free_blocks": 1, "total_blocks": 1})

    @spy.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        seen.setdefault("/v1/models", []).append(request.headers.get("authorization"))
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    with _router_over(spy) as url:
        assert httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"] == "fake"
    assert seen["/internal/load"] and all(h == f"Bearer {TOKEN}" for h in seen["/internal/load"])
    assert seen["/v1/models"] == [None], "the router leaked its internal token to a public route"


def test_router_cli_runs_uvicorn_with_read_timeouts_and_a_connection_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from pdcluster.worker.api import http_limits
    from pdcluster.worker.router import cli

    got: dict[str, Any] = {}
    monkeypatch.setattr(http_limits.ExitBoundServer, "run", lambda self: got.update(vars(self.config)))
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.run(p.parse_args(["--decode", "http://127.0.0.1:9"])) == 0
    assert got["limit_concurrency"] and got["timeout_keep_alive"] <= 10
    assert got["http"].__name__ == "BoundedH11Protocol"


def test_a_bomb_through_the_router_is_400_and_the_pool_stays_whole(router: str) -> None:
    # issue 38 row 1: the worker's RecursionError 500 made the router drop it; others then got 503 no_workers
    calls = [({"prompt": "a", "guided_json": "[" * 3000}, 400),
             ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [
                 {"type": "function", "function": {"name": "f", "arguments": "{\"a\":" * 3000}}]}]}, 400),
             ({"prompt": "a", "ignored": "[" * 3000}, 200)]  # brackets in a string are only text
    for body, status in calls:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = httpx.post(f"{router}{path}", json={**body, "max_tokens": 2}, timeout=30)
        assert r.status_code == status, r.text
    workers = httpx.get(f"{router}/cluster", timeout=10).json()["decode"]
    assert workers and all(w["healthy"] for w in workers)
    assert httpx.post(f"{router}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30).status_code == 200


def test_models_listing_survives_a_worker_that_cannot_answer_it_now() -> None:
    """A healthy worker busy past the listing's timeout (or restarting its HTTP side) made /v1/models a 503
    while the same worker served completions: the router answers the last listing a worker gave instead."""
    calls: list[int] = []
    spy = FastAPI()

    @spy.get("/internal/load")
    async def load() -> JSONResponse:
        return JSONResponse({"ready": True, "free_blocks": 1, "total_blocks": 1})

    @spy.get("/v1/models")
    async def models() -> JSONResponse:
        calls.append(1)
        if len(calls) > 1:
            return JSONResponse({"error": {"message": "busy"}}, status_code=503)
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    with _router_over(spy) as url:
        first = httpx.get(f"{url}/v1/models", timeout=10)
        second = httpx.get(f"{url}/v1/models", timeout=10)
    assert len(calls) == 2  # the worker was asked both times
    assert first.status_code == second.status_code == 200 and second.json() == first.json()
