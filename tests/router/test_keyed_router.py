"""Issue 38 rows 4 and 12 through the router: one `--api-key` in front of workers keyed the same way and sharing
no KV secret. The router guards every route but the probes (/cluster and /openapi.json reveal the cluster),
forwards the client's key on public calls (/v1/models was a 503), and its own /internal/* calls carry the key
(the workers guard those too)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from pdcluster.worker.api.api_key import install as install_api_key
from pdcluster.worker.router.app import RouterState, build_router_app
from pdcluster.worker.router.options import RouterOptions
from pdcluster.worker.router.pool import Pool
from pdcluster.worker.server.app import build_app
from pdcluster.worker.server.internal_routes import Disaggregation
from pdcluster.worker.transfer.options import TransferOptions

from ..netutil import serve
from ..server.disagg_fake import DisaggFakeEngine

KEY = {"Authorization": "Bearer K"}


@pytest.fixture(scope="module")
def router() -> Iterator[str]:
    engine = DisaggFakeEngine()
    d = Disaggregation(engine, role="decode", secret=None, options=TransferOptions(backend="tcp"))
    worker_app = build_app(engine, role="decode", served_model_name="fake", routers=[d.router],
                           on_startup=[d.start], on_shutdown=[d.stop], request_timeout=30)
    install_api_key(worker_app, "K")
    with serve(worker_app) as worker:
        state = RouterState(Pool(decode_urls=[worker], interval=0.2), RouterOptions(
            max_queue_depth=0, disaggregation_threshold=0, request_timeout=30, max_retries=1))
        with serve(build_router_app(state, api_key="K")) as url:
            # the router's startup probed /internal/load once before serving (Pool.start); that probe carries
            # the key too, so the keyed worker is healthy from the first request on
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200, "the router's probe was refused"
            yield url


@pytest.mark.parametrize("path", ["/cluster", "/openapi.json", "/v1/models"])
def test_state_revealing_routes_need_the_key(router: str, path: str) -> None:
    r = httpx.get(f"{router}{path}", timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{router}{path}", headers={"Authorization": "bearer K"}, timeout=30).status_code == 200


@pytest.mark.parametrize("path", ["/health", "/live", "/metrics", "/version"])
def test_probes_stay_open(router: str, path: str) -> None:
    assert httpx.get(f"{router}{path}", timeout=30).status_code == 200


def test_the_key_reaches_keyed_workers_on_every_call(router: str) -> None:
    models = httpx.get(f"{router}/v1/models", headers=KEY, timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "fake"
    r = httpx.post(f"{router}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, headers=KEY, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    tok = httpx.post(f"{router}/tokenize", json={"prompt": "hi"}, headers=KEY, timeout=30)
    assert tok.status_code == 200 and tok.json()["count"] == 2
