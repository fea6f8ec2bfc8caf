"""The router's prefix index corrected by the workers' own reports: a worker that evicted a prefix stops being
preferred for it (real block manager, real /internal/prefix-events route, real pool and flow), reports never
undo a newer dispatch, bad reports and bad queries are refused cleanly."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from typing import Any

import httpx
from fastapi import FastAPI

from pdcluster.worker.api.errors import install_error_handlers
from pdcluster.worker.engine.block_hash import prompt_block_hashes
from pdcluster.worker.engine.block_manager import BlockManager
from pdcluster.worker.engine.sampling_params import SamplingParams
from pdcluster.worker.engine.sequence import Sequence
from pdcluster.worker.router.flow import Tokenized
from pdcluster.worker.router.prefix_index import PrefixIndex, PrefixReport, parse_report
from pdcluster.worker.server.prefix_events import prefix_events_router

from .fakes import DECODE, DECODE2, Lines, Script, make_flow, tokens

SECRET = b"prefix-events-secret-0123456789ab"
TOKEN = hmac.new(SECRET, b"pdcluster-internal-v1", hashlib.sha256).hexdigest()


class Engine:
    """What the route needs of an AsyncEngine: `call(fn)` on something with a real block manager."""

    def __init__(self, num_blocks: int = 8, block_size: int = 16) -> None:
        self.block_manager = BlockManager(num_blocks, block_size)

    async def call(self, fn: Any) -> Any:
        return fn(self)

    def prefill(self, tokens: list[int], rid: str = "r") -> None:
        """As the engine does for a finished request: allocate (reusing the cached prefix), commit, free."""
        bm = self.block_manager
        s = Sequence(rid, tokens, SamplingParams())
        assert bm.allocate(s, len(tokens), bm.lookup_prefix(s))
        s.num_computed_tokens = len(tokens)
        bm.commit(s)
        bm.free_seq(s)


def worker_app(engine: Engine, secret: bytes | None = SECRET) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(prefix_events_router(engine, secret))
    return app


class ByHost(httpx.AsyncBaseTransport):
    """One ASGI app per worker URL, so the pool's single client reaches every fake worker."""

    def __init__(self, apps: dict[str, FastAPI]) -> None:
        self.apps = {url: httpx.ASGITransport(app=a) for url, a in apps.items()}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        return await self.apps[base].handle_async_request(request)


# ------------------------------------------------------------------ end to end
def test_a_worker_that_evicted_the_prefix_is_no_longer_preferred_for_it() -> None:
    async def go() -> list[str]:
        engines = {DECODE: Engine(), DECODE2: Engine()}
        script, seen = Script(), []

        def gen(url: str) -> Any:
            async def h(_: httpx.Request, body: dict[str, Any]) -> httpx.Response:
                seen.append(url)
                engines[url].prefill(body["prompt_token_ids"], f"r{len(seen)}")
                return httpx.Response(200, stream=Lines(tokens(10, 1)))
            return h

        for url in engines:
            script.on(url, "/internal/generate", gen(url))
        flow = make_flow(script, decode=(DECODE, DECODE2), prefill=(), threshold=10**9)
        pool = flow.pool
        pool.headers = {"Authorization": f"Bearer {TOKEN}"}
        pool.client = httpx.AsyncClient(transport=ByHost({u: worker_app(e) for u, e in engines.items()}),
                                        headers=pool.headers)
        for wk in pool.workers.values():
            wk.block_size, wk.total_blocks = 16, 8
        shared = list(range(100, 164))  # 4 blocks of 16

        async def ask(rid: str, prompt: list[int]) -> None:
            async for _ in flow.run(rid, Tokenized(prompt, {"max_tokens": 1}, "tiny")):
                pass

        pool.get("decode", DECODE).running = 1  # busy: the first request goes to DECODE2
        await ask("a", shared + [1] * 8)
        pool.get("decode", DECODE).running = 0
        await pool.sync_prefixes()  # first contact: the whole resident set, and a position in the log
        assert pool.cached_tokens("decode", shared + [2]) == {DECODE2: 64}
        await ask("b", shared + [2] * 8)  # affinity: back to DECODE2 although DECODE is first by URL
        engines[DECODE2].prefill(list(range(500, 628)), "other")  # 8 blocks of other work: the prefix is evicted
        await pool.sync_prefixes()
        assert pool.cached_tokens("decode", shared + [3]) == {}
        await ask("c", shared + [3] * 8)  # nobody holds it now: least loaded (URL order)
        await flow.close()
        return seen

    assert asyncio.run(go()) == [DECODE2, DECODE2, DECODE]


def test_a_report_never_removes_a_prefix_sent_after_its_poll() -> None:
    """The worker evicted the blocks, then the router sent that prompt again (it will compute them): a report
    from a poll sent before that dispatch must not remove them."""
    idx = PrefixIndex()
    hs = [11, 12, 13]
    idx.record("w", hs, now=5.0)
    idx.apply("w", PrefixReport("e", 3, evicted=(11, 12, 13)), before=6.0)
    assert idx.match("w", hs) == 0
    idx.record("w", hs, now=7.0)
    idx.apply("w", PrefixReport("e", 6, evicted=(11, 12, 13)), before=6.5)  # polled before the dispatch
    assert idx.match("w", hs) == 3
    # a whole-set report: what the worker holds, plus what was sent after the poll, most recent last
    idx.record("w", [99], now=1.0)
    idx.apply("w", PrefixReport("e", 6, resident=(40, 41)), before=6.5, capacity=4)
    assert idx.match("w", [99]) == 0 and idx.match("w", hs) == 3 and idx.match("w", [41]) == 1
    assert idx.size("w") == 4 and idx.match("w", [40]) == 0  # 5 entries, capacity 4: the LRU one (40) went


def test_malformed_reports_are_ignored_whole() -> None:
    good = {"epoch": "ab12", "seq": 3, "evicted": [1, -2], "resident": None}
    assert parse_report(good) == PrefixReport("ab12", 3, (1, -2), None)
    assert parse_report({**good, "resident": [5]}) == PrefixReport("ab12", 3, (1, -2), (5,))
    for bad in ([], {**good, "epoch": ""}, {**good, "seq": -1}, {**good, "seq": True}, {**good, "evicted": [1.5]},
                {**good, "evicted": "1"}, {**good, "resident": [True]}, {**good, "resident": {}}):
        assert parse_report(bad) is None, bad


def test_a_failing_or_foreign_worker_keeps_its_entry_and_its_health() -> None:
    async def go() -> None:
        flow = make_flow(Script(), decode=(DECODE,), prefill=())
        pool = flow.pool
        wk = pool.get("decode", DECODE)
        wk.block_size = 16
        pool.remember(wk, list(range(40)))
        for answer in (httpx.Response(404, json={"error": {}}), httpx.Response(200, json={"seq": "x"}),
                       httpx.Response(200, content=b"not json")):
            pool.client = httpx.AsyncClient(transport=httpx.MockTransport(lambda _, a=answer: a))
            assert not await pool.sync_prefix(wk)
            assert wk.healthy and pool.cached_tokens("decode", list(range(40))) == {DECODE: 32}
        pool.prefix_routing = False  # least-loaded: no polling at all
        assert not await pool.sync_prefix(wk)
        await flow.close()

    asyncio.run(go())


# ------------------------------------------------------------------ the worker's route
def test_the_route_is_authenticated_and_refuses_bad_queries_with_400() -> None:
    async def go() -> None:
        engine = Engine()
        engine.prefill(list(range(40)))
        transport = httpx.ASGITransport(app=worker_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://w") as c:
            assert (await c.get("/internal/prefix-events")).status_code == 401
            auth = {"Authorization": f"Bearer {TOKEN}"}
            whole = (await c.get("/internal/prefix-events", headers=auth)).json()
            assert sorted(whole["resident"]) == sorted(prompt_block_hashes(list(range(40)), 16))
            q = {"epoch": whole["epoch"], "since": "0"}
            assert (await c.get("/internal/prefix-events", headers=auth, params=q)).json()["resident"] is None
            for bad in ({"since": "-1"}, {"since": "x"}, {"since": str(1 << 70)},
                        {"since": "0", "epoch": "../../etc"}):
                r = await c.get("/internal/prefix-events", headers=auth, params=bad)
                assert r.status_code == 400, (bad, r.text)
                assert r.json()["error"]["type"] == "invalid_request_error"

    asyncio.run(go())
