"""Router -> worker `/internal/*` authentication: a bearer token derived from the shared KV secret."""

from __future__ import annotations

import argparse
import hashlib
import hmac
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pdcluster.worker.api import errors
from pdcluster.worker.engine.kv_connector import KVLayout
from pdcluster.worker.router import cli
from pdcluster.worker.server.internal_routes import Disaggregation
from pdcluster.worker.transfer.options import TransferOptions
from pdcluster.worker.transfer.secret import (
    SecretError,
    check_internal_auth,
    internal_headers,
    internal_token,
)

SECRET = b"internal-auth-secret-0123456789"
TOKEN = hmac.new(SECRET, b"pdcluster-internal-v1", hashlib.sha256).hexdigest()


def fake_engine() -> SimpleNamespace:
    # only the AsyncEngine surface the routes use (they never reach into the engine's internals)
    return SimpleNamespace(kv_layout=KVLayout(num_layers=2, kv_heads=1, head_dim=4, block_size=16),
                           stats=lambda: {"kv_cache_total_blocks": 10, "kv_cache_used_blocks": 3})


def worker_app(secret: bytes | None) -> TestClient:
    d = Disaggregation(fake_engine(), role="decode", secret=secret, options=TransferOptions(backend="tcp"))
    app = FastAPI()
    errors.install_error_handlers(app)
    app.include_router(d.router)
    app.state.worker = SimpleNamespace(ready=True, draining=False, in_flight=0)
    return TestClient(app)


def test_token_is_derived_not_the_secret() -> None:
    assert internal_token(SECRET) == TOKEN and SECRET.decode() not in TOKEN
    assert internal_headers(SECRET) == {"Authorization": f"Bearer {TOKEN}"}
    assert internal_headers(None) == {}
    assert check_internal_auth(None, None)  # no secret: local dev, as before
    assert check_internal_auth(SECRET, f"Bearer {TOKEN}") and check_internal_auth(SECRET, f"bearer {TOKEN}")
    for bad in (None, "", TOKEN, f"Basic {TOKEN}", f"Bearer {TOKEN[:-1]}", f"Bearer {SECRET.decode()}"):
        assert not check_internal_auth(SECRET, bad), bad


@pytest.mark.parametrize("path", ["/internal/load"])
def test_worker_rejects_missing_or_wrong_token(path: str) -> None:
    c = worker_app(SECRET)
    for headers in ({}, {"Authorization": "Bearer " + "0" * 64}, {"Authorization": f"Bearer {SECRET.decode()}"}):
        r = c.get(path, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_internal_token" and err["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"
    ok = c.get(path, headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200 and ok.json()["free_blocks"] == 7


def test_worker_rejects_unauthenticated_posts_before_reading_them() -> None:
    c = worker_app(SECRET)
    for path in ("/internal/reserve", "/internal/prefill", "/internal/decode", "/internal/generate",
                 "/internal/tokenize", "/internal/cancel"):
        assert c.post(path, json={"request_id": "x"}).status_code == 401, path
    # with the token the request gets past authentication (and fails on its body instead)
    r = c.post("/internal/tokenize", json={"kind": "chat", "body": 1}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 400


def test_worker_without_a_secret_needs_no_token() -> None:
    assert worker_app(None).get("/internal/load").status_code == 200


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p


def test_router_sends_the_token_from_file_or_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PDCLUSTER_KV_SECRET", raising=False)
    state = cli.build(parser().parse_args(["--decode", "http://a:1"])).state.router
    assert "authorization" not in state.pool.client.headers and "authorization" not in state.flow.client.headers

    f = tmp_path / "secret"
    f.write_bytes(SECRET + b"\n")
    state = cli.build(parser().parse_args(["--decode", "http://a:1", "--internal-secret-file", str(f)])).state.router
    assert state.pool.client.headers["authorization"] == f"Bearer {TOKEN}"  # /internal/load probes
    assert state.flow.client.headers["authorization"] == f"Bearer {TOKEN}"  # reserve/prefill/decode/...

    monkeypatch.setenv("PDCLUSTER_KV_SECRET", SECRET.decode())
    state = cli.build(parser().parse_args(["--decode", "http://a:1"])).state.router
    assert state.flow.client.headers["authorization"] == f"Bearer {TOKEN}"

    monkeypatch.setenv("PDCLUSTER_KV_SECRET", "short")
    with pytest.raises(SecretError):
        cli.build(parser().parse_args(["--decode", "http://a:1"]))
    assert cli.run(parser().parse_args(["--decode", "http://a:1"])) == 2
