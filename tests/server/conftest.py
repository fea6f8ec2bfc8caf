"""Fixtures for the HTTP server tests: a fake engine (fast, deterministic) and the real engine on a
tiny random demo model, each behind a real uvicorn server on a loopback port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdcluster.worker.server.app import build_app

from .fake_engine import FakeEngine
from .harness import serve


# One server per test module: starting uvicorn per test would dominate the suite's runtime.
# Tests that need special engine settings or server state build their own with `serve`.
@pytest.fixture(scope="module")
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def fake_url(fake_engine: FakeEngine) -> Iterator[str]:
    app = build_app(fake_engine, role="decode", served_model_name="fake", request_timeout=30)
    with serve(app) as url:
        yield url


@pytest.fixture
def client(fake_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fake_url, timeout=30) as c:
        yield c


# ---------------------------------------------------------------- the real engine on a tiny model


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdcluster.worker.local.demo_model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("server-model"), num_hidden_layers=2, max_position_embeddings=256)


@pytest.fixture(scope="module")
def real_engine(demo_model_dir: Path) -> Iterator[Any]:
    from pdcluster.worker.engine.async_engine import AsyncEngine
    from pdcluster.worker.engine.llm_engine import EngineConfig

    engine = AsyncEngine.from_config(
        EngineConfig(model=str(demo_model_dir), block_size=8, num_kv_blocks=128, max_batch_size=4, num_threads=1)
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def real_url(real_engine: Any) -> Iterator[str]:
    app = build_app(real_engine, role="both", served_model_name="demo", max_queue_depth=64, request_timeout=60)
    with serve(app) as url:
        yield url


@pytest.fixture
def real_client(real_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=real_url, timeout=60) as c:
        yield c
