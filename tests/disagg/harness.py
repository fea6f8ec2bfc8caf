"""In-process clusters for the disaggregation tests: real uvicorn servers (router + workers) on loopback
ports in background threads, each worker with its own AsyncEngine thread and KV transfer listener."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..netutil import free_port, serve  # noqa: F401  (re-exported to the tests)

SECRET = b"test-secret-0123456789abcdef"
AUTH = {"Authorization": "Bearer " + hmac.new(SECRET, b"pdcluster-internal-v1", hashlib.sha256).hexdigest()}


def make_worker(model: Path, role: str, *, block_size: int = 16, num_kv_blocks: int = 256,
                compression: str = "none", secret: bytes | None = SECRET, backend: str = "tcp",
                tool_call_parser: str | None = None, **engine_kw: Any) -> tuple[Any, Any]:
    """(app, AsyncEngine) of one worker with the disaggregation routes mounted."""
    from pdcluster.worker.engine.async_engine import AsyncEngine
    from pdcluster.worker.engine.llm_engine import EngineConfig
    from pdcluster.worker.server.app import build_app
    from pdcluster.worker.server.internal_routes import Disaggregation
    from pdcluster.worker.transfer.options import TransferOptions

    engine = AsyncEngine.from_config(EngineConfig(model=str(model), block_size=block_size,
                                                  num_kv_blocks=num_kv_blocks, num_threads=1, **engine_kw))
    d = Disaggregation(engine, role=role, secret=secret,
                       options=TransferOptions(compression=compression, timeout_s=10.0, backend=backend))

    async def shutdown() -> None:
        engine.shutdown()

    app = build_app(engine, role=role, served_model_name="tiny", routers=[d.router], on_startup=[d.start],
                    on_shutdown=[d.stop, shutdown], request_timeout=60, internal_secret=secret,
                    tool_call_parser=tool_call_parser)
    app.state.disagg = d
    return app, engine


@dataclass
class Cluster:
    router: str
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    engines: list[Any] = field(default_factory=list)
    disaggs: list[Any] = field(default_factory=list)  # each worker's Disaggregation (its connector: leak checks)
    state: Any = None


@contextlib.contextmanager
def cluster(model: Path, *, prefill_blocks: tuple[int, ...] = (8,), decode_blocks: tuple[int, ...] = (16,),
            threshold: int = 0, max_queue_depth: int | None = None, request_timeout: float | None = 60.0,
            max_retries: int = 2, compression: str = "none", num_kv_blocks: int = 256,
            prefill_kw: dict[str, Any] | None = None, decode_role: str = "decode",
            decode_secret: bytes | None = SECRET, prefill_secret: bytes | None = SECRET,
            backend: str = "tcp", tool_call_parser: str | None = None) -> Iterator[Cluster]:
    from pdcluster.worker.router.app import RouterState, build_router_app
    from pdcluster.worker.router.options import RouterOptions
    from pdcluster.worker.router.pool import Pool

    with contextlib.ExitStack() as stack:
        c = Cluster(router="")
        for role, sizes, urls in (("prefill", prefill_blocks, c.prefill), ("decode", decode_blocks, c.decode)):
            for bs in sizes:
                kw = (prefill_kw or {}) if role == "prefill" else {}
                app, engine = make_worker(model, role if role == "prefill" else decode_role, block_size=bs,
                                          compression=compression, num_kv_blocks=num_kv_blocks,
                                          secret=prefill_secret if role == "prefill" else decode_secret,
                                          backend=backend, tool_call_parser=tool_call_parser, **kw)
                c.engines.append(engine)
                c.disaggs.append(app.state.disagg)
                urls.append(stack.enter_context(serve(app)))
        pool = Pool(prefill_urls=c.prefill, decode_urls=c.decode, interval=0.2,
                    secret=prefill_secret or decode_secret)
        opts = RouterOptions(max_queue_depth=max_queue_depth or 0, disaggregation_threshold=threshold,
                             request_timeout=request_timeout or 0, max_retries=max_retries)  # 0: unbounded
        c.state = RouterState(pool, opts, tool_call_parser=tool_call_parser)
        c.router = stack.enter_context(serve(build_router_app(c.state)))
        yield c


def idle_everywhere(c: Cluster, timeout: float = 10.0) -> list[dict[str, Any]]:
    """Poll every worker's /internal/load until no block is used and nothing is pending; returns the loads
    (the caller asserts on them, so a leak fails the test with the numbers in the message)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        loads = [httpx.get(f"{u}/internal/load", headers=AUTH, timeout=5).json() for u in c.prefill + c.decode]
        if all(d["used_blocks"] == 0 and d["pending_loads"] == 0 and d["in_flight"] == 0 for d in loads):
            return loads
        if time.monotonic() > deadline:
            return loads
        time.sleep(0.05)


def metric(url: str, name: str) -> float:
    import httpx

    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total
