"""Issue 15 item 2: /drain takes the /internal/* token, can be undone (/undrain), and a router whose only decode
worker is drained answers 503 + Retry-After at once (no hang) with its /health saying so; after /undrain the
router takes requests again. The operator's drain call sends the token."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from .harness import AUTH, SECRET, cluster


def wait_for(cond, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


@pytest.mark.timeout(180)
def test_drain_needs_the_token_undrain_restores_and_router_refuses_at_once(tiny_model_dir: Path) -> None:
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0}
    with cluster(tiny_model_dir, threshold=10_000, request_timeout=60) as c, httpx.Client(timeout=30) as h:
        decode = c.decode[0]
        assert wait_for(lambda: h.get(f"{c.router}/health").status_code == 200)
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": AUTH["Authorization"] + "0"}):
            for path in ("/drain", "/undrain"):
                r = h.post(f"{decode}{path}", headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_internal_token", (path, r.text)
        assert h.get(f"{decode}/health").json()["status"] == "ok"  # the refused drain did nothing

        assert h.post(f"{decode}/drain", headers=AUTH).json()["status"] == "draining"
        assert wait_for(lambda: h.get(f"{c.router}/health").status_code == 503)
        health = h.get(f"{c.router}/health").json()
        assert health["status"] == "no_decode_workers" and health["healthy_decode_workers"] == 0
        assert h.get(f"{c.router}/live").status_code == 200
        t0 = time.monotonic()
        r = h.post(f"{c.router}/v1/completions", json=body)
        assert time.monotonic() - t0 < 30.0  # at once, not at the request timeout (60 s); loose for a loaded machine
        assert r.status_code == 503 and r.headers.get("retry-after") and r.json()["error"]["code"] == "no_decode_worker"

        assert h.post(f"{decode}/undrain", headers=AUTH).json()["status"] == "ok"
        assert wait_for(lambda: h.get(f"{c.router}/health").status_code == 200)
        r = h.post(f"{c.router}/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


async def test_operator_drain_call_sends_the_internal_token() -> None:
    from pdcluster.operator import drain

    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"status": "draining"})

    pod = {"metadata": {"name": "p"}, "status": {"podIP": "10.0.0.7"}}
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        assert await drain.drain_pod(pod, http, secret=SECRET)
        assert await drain.drain_pod(pod, http, secret=None)  # local dev: no secret, no header
    assert seen == [AUTH["Authorization"], None]
