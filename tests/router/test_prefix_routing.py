"""Prefix-cache-aware routing: the shared block hashes, the router's bounded per-worker index, the pure picks
(longest cached prefix wins, within a load cap that overrides affinity) and Flow using them end to end."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import httpx

from pdcluster.worker.engine.block_hash import cacheable_blocks, chain_hash, prompt_block_hashes
from pdcluster.worker.router.flow import Tokenized
from pdcluster.worker.router.picking import WorkerView, pick_prefill, rank_decode
from pdcluster.worker.router.prefix_index import PrefixIndex

from .fakes import DECODE, DECODE2, Lines, Script, make_flow, tokens


def w(url: str, **kw: Any) -> WorkerView:
    return WorkerView(url=url, role=str(kw.pop("role", "decode")), **kw)


# ------------------------------------------------------------------ hashes
def test_block_hashes_chain_like_the_engine_and_skip_the_last_token() -> None:
    prompt = list(range(40))
    hs = prompt_block_hashes(prompt, 16)
    assert len(hs) == 2 == cacheable_blocks(40, 16)
    assert hs[0] == chain_hash(None, tuple(range(16)))
    assert hs[1] == chain_hash(hs[0], tuple(range(16, 32)))
    assert len(prompt_block_hashes(list(range(33)), 16)) == 2  # token 33 ends block 2: computed, never cached
    assert len(prompt_block_hashes(list(range(32)), 16)) == 1
    # same block after a different prefix: a different hash (prefixes, not blocks, are what match)
    assert prompt_block_hashes([9] * 16 + list(range(16, 33)), 16)[1] != hs[1]


def test_block_hashes_are_the_same_in_another_process() -> None:
    """Router and workers are different processes: the hash must not depend on per-process state (on 3.11
    hash(None) does, which is why the chain's root is an integer)."""
    code = ("from pdcluster.worker.engine.block_hash import prompt_block_hashes as h;"
            "print(h(list(range(50)), 16))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(prompt_block_hashes(list(range(50)), 16))


def test_engine_block_manager_uses_the_shared_hash() -> None:
    from pdcluster.worker.engine import block_manager

    assert block_manager.chain_hash is chain_hash


# ------------------------------------------------------------------ index
def test_index_matches_leading_blocks_only_and_is_bounded_lru() -> None:
    idx = PrefixIndex()
    idx.record("a", [1, 2, 3], capacity=4)
    assert idx.match("a", [1, 2, 3, 4]) == 3
    assert idx.match("a", [9, 2, 3]) == 0  # a different first block: nothing shared
    assert idx.match("b", [1]) == 0
    idx.record("a", [7, 8], capacity=4)  # 1 is now the least recently routed: evicted
    assert idx.size("a") == 4
    assert idx.match("a", [1, 2, 3]) == 0
    idx.record("a", [2], capacity=4)  # touching keeps 2; 3 goes next
    idx.record("a", [5], capacity=4)
    assert idx.match("a", [2]) == 1 and idx.match("a", [2, 3]) == 1
    idx.forget("a")
    assert idx.size("a") == 0


# ------------------------------------------------------------------ pure picks
def test_prefill_prefers_the_cached_prefix_over_a_slightly_shorter_queue() -> None:
    ws = [w("a", role="prefill", outstanding_prompt_tokens=100, in_flight=1),
          w("b", role="prefill", outstanding_prompt_tokens=0)]
    assert pick_prefill(ws, prompt_tokens=2000).url == "b"  # no cache info: least loaded
    assert pick_prefill(ws, prompt_tokens=2000, cached={"a": 1536}).url == "a"  # 100+464 < 0+2000
    # a cached prefix worth less than the queue in front of it loses
    assert pick_prefill(ws, prompt_tokens=2000, cached={"a": 64}).url == "b"


def test_prefill_load_cap_overrides_affinity() -> None:
    hot = w("hot", role="prefill", outstanding_prompt_tokens=50, in_flight=9)
    cold = w("cold", role="prefill", outstanding_prompt_tokens=10, in_flight=0)
    # everything cached on `hot`, and by tokens it would even win, but it is 9 requests deeper: cold
    assert pick_prefill([hot, cold], prompt_tokens=5000, cached={"hot": 4992}, slack=4).url == "cold"
    assert pick_prefill([hot, cold], prompt_tokens=5000, cached={"hot": 4992}, slack=16).url == "hot"


def test_decode_rank_puts_the_longest_cached_prefix_first_within_the_load_band() -> None:
    ws = [w("idle"), w("warm", running=2), w("warmer", running=3), w("swamped", running=40)]
    cached = {"warm": 512, "warmer": 1024, "swamped": 4096}
    order = [v.url for v in rank_decode(ws, cached=cached, slack=4)]
    assert order == ["warmer", "warm", "idle", "swamped"]  # swamped holds the most, but is past the cap
    assert [v.url for v in rank_decode(ws)] == ["idle", "warm", "warmer", "swamped"]


def test_pick_never_piles_everything_on_one_worker() -> None:
    """Every request shares one prefix cached on `a`: the router's own in-flight count grows on `a` until
    the cap sends the rest elsewhere."""
    views = {"a": 0, "b": 0}
    for _ in range(20):
        ranked = rank_decode([w(u, in_flight=n) for u, n in views.items()], cached={"a": 4096}, slack=4)
        views[ranked[0].url] += 1
    assert views["a"] <= views["b"] + 5 and views["b"] >= 7


# ------------------------------------------------------------------ Flow, end to end
def test_flow_sends_a_shared_prefix_back_to_the_worker_that_has_it() -> None:
    async def go() -> list[str]:
        script = Script()
        seen: list[str] = []

        def gen(url: str) -> Any:
            async def h(_: httpx.Request, body: dict[str, Any]) -> httpx.Response:
                seen.append(url)
                return httpx.Response(200, stream=Lines(tokens(10, 1)))
            return h

        for url in (DECODE, DECODE2):
            script.on(url, "/internal/generate", gen(url))
        flow = make_flow(script, decode=(DECODE, DECODE2), prefill=(), threshold=10**9)
        for wk in flow.pool.workers.values():
            wk.block_size, wk.total_blocks = 16, 100
        shared = list(range(100, 164))  # 4 blocks of 16
        flow.pool.remember(flow.pool.get("decode", DECODE2), shared + [1])  # DECODE2 prefilled it earlier
        for i, prompt in enumerate((shared + [2] * 20, [7000] * 80, shared + [3] * 20)):
            async for _ in flow.run(f"r{i}", Tokenized(prompt, {"max_tokens": 1}, "tiny")):
                pass
        assert flow.prefix_expected_tokens == 128  # both shared prompts were expected to hit 4 blocks
        assert flow.prefix_routed_tokens == 84 * 2 + 80
        flow.pool.prefix_routing = False  # least-loaded picking: idle workers in URL order
        async for _ in flow.run("r3", Tokenized(shared + [4] * 20, {"max_tokens": 1}, "tiny")):
            pass
        await flow.close()
        return seen

    seen = asyncio.run(go())
    # the shared prompts go to DECODE2 although URL order (all idle) prefers DECODE; the unrelated one does not
    assert seen == [DECODE2, DECODE, DECODE2, DECODE]


def test_a_worker_back_from_down_is_assumed_to_have_an_empty_cache() -> None:
    async def go() -> None:
        flow = make_flow(Script(), decode=(DECODE,), prefill=())
        wk = flow.pool.get("decode", DECODE)
        wk.block_size = 16
        flow.pool.remember(wk, list(range(40)))
        assert flow.pool.cached_tokens("decode", list(range(40))) == {DECODE: 32}
        wk.healthy = False

        async def ok(_: httpx.Request) -> httpx.Response:
            return httpx.Response(200, json={"ready": True, "block_size": 16})

        flow.pool.client = httpx.AsyncClient(transport=httpx.MockTransport(ok))
        await flow.pool.probe(wk)
        assert wk.healthy and flow.pool.cached_tokens("decode", list(range(40))) == {}
        flow.pool.prefix_routing = False
        flow.pool.remember(wk, list(range(40)))
        assert flow.pool.prefix.size(DECODE) == 0
        await flow.close()

    asyncio.run(go())
