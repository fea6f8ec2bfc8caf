"""The server on the real AsyncEngine and a tiny random Llama: text, ids, streaming, chat, KV freeing."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from pdcluster.worker.api.metrics import SERIES

from .harness import metric, raw_post, wait_until
from .sse import events, first_event

GREEDY = {"temperature": 0, "ignore_eos": True}


def _used_blocks(engine: Any) -> int:
    return int(engine.stats()["kv_cache_used_blocks"])


def _idle(engine: Any) -> bool:
    s = engine.stats()
    return s["kv_cache_used_blocks"] == 0 and s["requests_running"] == 0 and s["requests_waiting"] == 0


def test_text_completion_stream_matches_non_stream(real_client: httpx.Client) -> None:
    body = {"prompt": "def main():", "max_tokens": 8, "return_token_ids": True, **GREEDY}
    r = real_client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert len(choice["token_ids"]) == 8 and usage["completion_tokens"] == 8
    assert choice["finish_reason"] == "length"
    with real_client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                              "stream_options": {"include_usage": True}}) as s:
        evs = events(s)
    assert evs[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in evs[:-2]) == choice["text"]
    assert [t for e in evs[:-2] for t in e["choices"][0]["token_ids"]] == choice["token_ids"]
    assert evs[-2]["usage"] == usage and evs[-2]["choices"] == []


def test_token_id_prompt_and_seeded_sampling(real_client: httpx.Client) -> None:
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 1.0, "seed": 1234, "return_token_ids": True,
            "ignore_eos": True}
    a = real_client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    b = real_client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    assert a == b and len(a) == 6


def test_chat_with_the_models_template(real_client: httpx.Client, real_engine: Any) -> None:
    msgs = [{"role": "user", "content": "hello"}]
    r = real_client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, **GREEDY})
    assert r.status_code == 200, r.text
    tok = real_engine.engine.tokenizer
    expected = tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
    assert r.json()["usage"]["prompt_tokens"] == len(expected)
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_bad_inputs_against_the_real_model(real_client: httpx.Client) -> None:
    vocab = real_client.get("/v1/models").json()["data"][0]
    assert vocab["max_model_len"] == 256
    for body in ({"prompt": [1, 10**6]}, {"prompt": "x", "max_tokens": 300}, {"prompt": [1] * 250, "max_tokens": 10}):
        r = real_client.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert real_client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1}).status_code == 200


def test_stream_disconnect_frees_kv_blocks(real_client: httpx.Client, real_engine: Any) -> None:
    with real_client.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 200, **GREEDY,
                                                               "stream": True}) as s:
        first_event(s)
        # stats() is a snapshot taken after each engine step, so poll rather than read once
        assert wait_until(lambda: _used_blocks(real_engine) > 0)
    assert wait_until(lambda: _idle(real_engine), timeout=30)


def test_non_stream_disconnect_frees_kv_blocks(real_url: str, real_engine: Any) -> None:
    before = real_engine.stats()["generation_tokens_total"]
    sock = raw_post(real_url, "/v1/completions", {"prompt": "x", "max_tokens": 250, **GREEDY})
    assert wait_until(lambda: _used_blocks(real_engine) > 0)
    sock.close()  # hang up while the request is generating
    assert wait_until(lambda: _idle(real_engine), timeout=30)
    assert real_engine.stats()["generation_tokens_total"] - before < 250  # it was cut short, not finished


def test_concurrent_requests_match_sequential(real_url: str, real_client: httpx.Client, real_engine: Any) -> None:
    prompts = [[3 + i] * (1 + 7 * i) for i in range(6)]  # lengths across block boundaries
    bodies = [{"prompt": p, "max_tokens": 5 + i, "return_token_ids": True, **GREEDY} for i, p in enumerate(prompts)]
    sequential = [real_client.post("/v1/completions", json=b).json()["choices"][0]["token_ids"] for b in bodies]

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=real_url, timeout=60) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))

    concurrent = [r.json()["choices"][0]["token_ids"] for r in asyncio.run(together())]
    assert concurrent == sequential
    assert wait_until(lambda: _idle(real_engine))


def test_metrics_reflect_engine_state(real_client: httpx.Client) -> None:
    real_client.post("/v1/completions", json={"prompt": "metrics", "max_tokens": 3, **GREEDY})
    text = real_client.get("/metrics").text
    for name in SERIES:
        assert f"# TYPE {name.removesuffix('_total')}" in text, name
    assert (metric(text, "pdcluster_generation_tokens_total", role="both") or 0) >= 3
    assert (metric(text, "pdcluster_time_to_first_token_seconds_count", role="both") or 0) >= 1
    assert metric(text, "pdcluster_kv_cache_used_blocks", role="both") is not None


def test_model_without_tokenizer_serves_token_ids_only(tmp_path: Any) -> None:
    from pdcluster.worker.engine.async_engine import AsyncEngine
    from pdcluster.worker.engine.llm_engine import EngineConfig
    from pdcluster.worker.local.demo_model import build_demo_model
    from pdcluster.worker.server.app import build_app

    from .harness import serve

    folder = build_demo_model(tmp_path / "m", tokenizer=False, num_hidden_layers=1, vocab_size=64,
                              hidden_size=32, intermediate_size=64, max_position_embeddings=64)
    engine = AsyncEngine.from_config(EngineConfig(model=str(folder), num_kv_blocks=16, block_size=8))
    try:
        with serve(build_app(engine)) as url, httpx.Client(base_url=url, timeout=60) as c:
            r = c.post("/v1/completions", json={"prompt": "text", "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["code"] == "no_tokenizer"
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 400 and r.json()["error"]["code"] == "no_tokenizer"
            r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2, "return_token_ids": True,
                                                "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"][0]["token_ids"]) == 2
            assert c.post("/v1/completions", json={"prompt": [64]}).status_code == 400  # vocab is 64
    finally:
        engine.shutdown()
