"""Greedy output through router -> prefill -> KV transfer -> decode equals the monolithic engine's, token
for token, for many prompt lengths, concurrently, with different block sizes on the two sides."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from .harness import cluster, idle_everywhere, metric

MAX_NEW = 8
# Lengths around the block boundaries of both sides (8, 16 and 32).
LENGTHS = [1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 50, 64, 100]


def prompts(lengths: list[int] = LENGTHS, vocab: int = 1000) -> list[list[int]]:
    return [[(37 * n + 11 * i) % vocab + 3 for i in range(n)] for n in lengths]


def reference(model: Path, ps: list[list[int]]) -> list[list[int]]:
    from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine
    from pdcluster.worker.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=512, num_threads=1))
    return engine.generate(ps, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))


async def run_all(url: str, ps: list[list[int]], stream: bool) -> list[list[int]]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(p: list[int]) -> list[int]:
            body = {"prompt": p, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True, "stream": stream}
            if not stream:
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return list(r.json()["choices"][0]["token_ids"])
            ids: list[int] = []
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        d = json.loads(line[6:])
                        assert "error" not in d, d
                        ids.extend(d["choices"][0].get("token_ids") or [])
            return ids

        return list(await asyncio.gather(*(one(p) for p in ps)))


@pytest.mark.slow
def test_disaggregated_greedy_equals_monolithic(tiny_model_dir: Path) -> None:
    ps = prompts()
    want = reference(tiny_model_dir, ps)
    with cluster(tiny_model_dir, prefill_blocks=(8,), decode_blocks=(16, 32)) as c:
        got = asyncio.run(run_all(c.router, ps, stream=False))
        got_stream = asyncio.run(run_all(c.router, ps, stream=True))
        loads = idle_everywhere(c)
        # both decode workers (block sizes 16 and 32) received KV from the block-size-8 prefill worker
        received = [metric(u, "pdcluster_kv_transfer_bytes_total") for u in c.decode]
        joined = [metric(u, "pdcluster_decode_join_seconds_count") for u in c.decode]  # t_join was timed
        snap = httpx.get(f"{c.router}/cluster").json()
    assert got == want
    assert got_stream == want
    assert all(b > 0 for b in received), received
    assert all(n > 0 for n in joined), joined
    assert all(d["used_blocks"] == 0 and d["pending_loads"] == 0 for d in loads), loads
    assert snap["router"]["retries"] == 0


@pytest.mark.slow
def test_chunked_prefill_ships_token_ranges_and_short_prompts_skip_prefill(tiny_model_dir: Path) -> None:
    """A prefill token budget of 16 splits long prompts into chunks: each layer leaves in several token
    ranges. Prompts under the threshold (24) are prefilled on the decode worker itself."""
    lengths = [3, 10, 23, 24, 40, 70]
    ps = prompts(lengths)
    want = reference(tiny_model_dir, ps)
    with cluster(tiny_model_dir, prefill_blocks=(16,), decode_blocks=(8,), threshold=24,
                 prefill_kw={"max_batch_tokens": 16}) as c:
        got = asyncio.run(run_all(c.router, ps, stream=True))
        prefill_prompt_tokens = metric(c.prefill[0], "pdcluster_prompt_tokens_total")
        loads = idle_everywhere(c)
    assert got == want
    assert prefill_prompt_tokens == sum(n for n in lengths if n >= 24)
    assert all(d["used_blocks"] == 0 for d in loads), loads


@pytest.mark.slow
def test_chat_and_text_prompts_through_the_router(tiny_model_dir: Path) -> None:
    with cluster(tiny_model_dir, threshold=0) as c, httpx.Client(base_url=c.router, timeout=60) as client:
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hello there, how are you today?"}],
            "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] >= 1
        r = client.post("/v1/completions", json={"prompt": "def main():", "max_tokens": 4, "temperature": 0,
                                                 "stream": True})
        events = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and all("error" not in e for e in events)
        # invalid input is a 400 from the router too (validated by a worker), never a 422 or 5xx
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})
        assert r.status_code == 400 and "error" in r.json()
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
        cl = client.get("/cluster").json()
        assert {"prefill", "decode"} <= set(cl) and cl["prefill"][0]["healthy"] is True
        m = client.get("/metrics").text
        assert 'pdcluster_router_requests_in_stage{role="router",stage="transfer"}' in m
        assert "pdcluster_time_to_first_token_seconds_bucket" in m


@pytest.mark.slow
def test_decode_pool_without_transfer_path_prefills_itself(tiny_model_dir: Path) -> None:
    """A `both` worker without a KV secret in the decode pool cannot receive KV: long prompts are served
    there directly instead of waiting forever for a reservation."""
    ps = prompts([20, 40])
    want = reference(tiny_model_dir, ps)
    with cluster(tiny_model_dir, threshold=0, decode_role="both", decode_secret=None) as c:
        got = asyncio.run(run_all(c.router, ps, stream=False))
        assert metric(c.prefill[0], "pdcluster_kv_transfer_bytes_total") == 0
    assert got == want
    # the same with the secret missing on the prefill side instead
    with cluster(tiny_model_dir, threshold=0, prefill_secret=None) as c:
        got = asyncio.run(run_all(c.router, ps, stream=False))
        leaks = idle_everywhere(c)
    assert got == want and all(d["used_blocks"] == 0 for d in leaks), leaks


SEED = 4321


def seeded_reference(model: Path, prompt: list[int], n: int) -> list[int]:
    from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine
    from pdcluster.worker.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=256, num_threads=1))
    return engine.generate([prompt], SamplingParams(max_tokens=n, temperature=1.0, seed=SEED, ignore_eos=True))[0]


async def seeded_stream(url: str, prompt: list[int], n: int, on_tokens: Any = None) -> list[int]:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 1.0, "seed": SEED, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    ids: list[int] = []
    async with httpx.AsyncClient(timeout=120) as client, client.stream("POST", f"{url}/v1/completions",
                                                                       json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                d = json.loads(line[6:])
                assert "error" not in d, d
                ids.extend(d["choices"][0].get("token_ids") or [])
                if on_tokens is not None:
                    await on_tokens(len(ids))
    return ids


@pytest.mark.slow
def test_seeded_sampling_is_the_same_on_every_path(tiny_model_dir: Path) -> None:
    """Same seed, temperature 1.0: the same tokens from one engine, from a worker alone, disaggregated
    (the prefill worker samples token 0, the decode worker continues) and after a decode worker fails
    mid-stream and another resumes it. Before, the decode worker's generator restarted: [a, a, b, c, ...]."""
    prompt = prompts([40])[0]
    n = 120
    want = seeded_reference(tiny_model_dir, prompt, n)
    with cluster(tiny_model_dir, prefill_blocks=(8,), decode_blocks=(16, 32), threshold=0) as c:
        alone = asyncio.run(seeded_stream(c.decode[0], prompt, n))
        disagg = asyncio.run(seeded_stream(c.router, prompt, n))
        assert metric(c.prefill[0], "pdcluster_kv_transfer_bytes_total") > 0  # it did go through prefill
        decode_engines = c.engines[1:]
        failed: list[str] = []

        async def fail_decode_once(count: int) -> None:
            # after a few tokens, abort the request on the decode worker running it: the router resumes it
            # elsewhere with prompt + the tokens delivered so far
            if count >= 5 and not failed:
                for eng in decode_engines:
                    for rid in await eng.call(lambda e: list(e.seqs)):
                        eng.abort(rid)
                        failed.append(rid)

        resumed = asyncio.run(seeded_stream(c.router, prompt, n, fail_decode_once))
        snap = httpx.get(f"{c.router}/cluster").json()
        loads = idle_everywhere(c)
    assert alone == want
    assert disagg == want
    assert failed and snap["router"]["resumes"] >= 1, (failed, snap["router"])
    assert resumed == want
    assert all(d["used_blocks"] == 0 for d in loads), loads
