"""Malformed `/internal/*` bodies (issue 15 item 6) over real HTTP: each is a 400 naming the problem, never a
500 and never data that reaches the engine; the same request checks hold as on the public path."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdcluster.worker.server.app import build_app
from pdcluster.worker.server.internal_routes import Disaggregation
from pdcluster.worker.transfer.options import TransferOptions

from .disagg_fake import DisaggFakeEngine
from .harness import serve
from .test_bad_input import assert_openai_400

SECRET = b"internal-bodies-secret-0123456789"
AUTH = {"Authorization": "Bearer " + hmac.new(SECRET, b"pdcluster-internal-v1", hashlib.sha256).hexdigest()}


@contextlib.contextmanager
def internal_app(role: str = "decode", kv_heads: int | None = None) -> Iterator[tuple[httpx.Client, DisaggFakeEngine]]:
    """A worker of ``role`` over real HTTP with the fake engine (its model given ``kv_heads`` KV heads)."""
    engine = DisaggFakeEngine()
    if kv_heads is not None:
        engine.kv_layout.kv_heads = engine.engine.model_config.num_kv_heads = kv_heads
    d = Disaggregation(engine, role=role, secret=SECRET, options=TransferOptions(backend="tcp"))
    app = build_app(engine, role=role, served_model_name="fake", routers=[d.router], on_startup=[d.start],
                    on_shutdown=[d.stop], request_timeout=30)
    with serve(app) as url, httpx.Client(base_url=url, headers=AUTH, timeout=30) as c:
        yield c, engine


@pytest.fixture(scope="module")
def internal() -> Iterator[tuple[httpx.Client, DisaggFakeEngine]]:
    with internal_app() as got:
        yield got


GOOD_PARAMS = {"max_tokens": 2, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": [],
               "stop_token_ids": [], "ignore_eos": False}
RUN = {"request_id": "r1", "prompt_token_ids": [1, 2, 3], "params": GOOD_PARAMS}

CASES: list[tuple[str, str, Any]] = [
    ("reserve empty", "/internal/reserve", {}),
    ("reserve ids not a list", "/internal/reserve", {**RUN, "prompt_token_ids": "abc"}),
    ("reserve params missing", "/internal/reserve", {"request_id": "r", "prompt_token_ids": [1]}),
    ("reserve id out of vocab", "/internal/reserve", {**RUN, "prompt_token_ids": [1, 10_000]}),
    ("generate stop is a number", "/internal/generate", {**RUN, "params": {**GOOD_PARAMS, "stop": 5}}),
    ("generate stop ids out of vocab", "/internal/generate",
     {**RUN, "params": {**GOOD_PARAMS, "stop_token_ids": [10_000]}}),
    ("generate temperature a string", "/internal/generate", {**RUN, "params": {**GOOD_PARAMS, "temperature": "x"}}),
    ("generate max_tokens 0", "/internal/generate", {**RUN, "params": {**GOOD_PARAMS, "max_tokens": 0}}),
    ("generate unknown param", "/internal/generate", {**RUN, "params": {**GOOD_PARAMS, "bogus": 1}}),
    ("generate request_id not a string", "/internal/generate", {**RUN, "request_id": {"a": 1}}),
    ("generate empty prompt", "/internal/generate", {**RUN, "prompt_token_ids": []}),
    ("prefill no target", "/internal/prefill", RUN),
    ("prefill port not a number", "/internal/prefill", {**RUN, "target": {"host": "127.0.0.1", "port": "x"}}),
    ("decode empty", "/internal/decode", {}),
    ("decode first token a string", "/internal/decode", {"request_id": "r", "first_token_id": "x"}),
    ("cancel empty", "/internal/cancel", {}),
    ("tokenize empty", "/internal/tokenize", {}),
    ("tokenize unknown kind", "/internal/tokenize", {"kind": "embeddings", "body": {"prompt": "a"}}),
    ("tokenize body not an object", "/internal/tokenize", {"kind": "completions", "body": [1]}),
    ("tokenize stop ids out of vocab", "/internal/tokenize",
     {"kind": "completions", "body": {"prompt": "a", "stop_token_ids": [10_000]}}),
    ("tokenize unimplemented field", "/internal/tokenize",
     {"kind": "chat", "body": {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed_internal_body_is_400(internal: tuple[httpx.Client, DisaggFakeEngine], case: tuple[str, str, Any]) -> None:
    c, engine = internal
    _, path, body = case
    before = list(engine.seen)
    assert_openai_400(c.post(path, json=body))
    assert engine.seen == before, "a malformed internal body reached the engine"


def test_hostile_json_on_internal_routes_is_400(internal: tuple[httpx.Client, DisaggFakeEngine]) -> None:
    c, _ = internal
    for raw in (b'{"request_id": "r", "first_token_id": NaN}', b'{"kind": "chat", "body": ' + b"[" * 5000 + b"]" * 5000
                + b"}", b'{"request_id": "a\\ud800"}'):
        assert_openai_400(c.post("/internal/decode", content=raw, headers={"content-type": "application/json"}))


def test_reserve_with_an_impossible_prefill_tp_is_400_and_holds_nothing() -> None:
    """A prefill TP that cannot split the model's KV heads (3 ranks, 4 heads) is refused before any block is
    reserved, not a 500 after (the router only sends prefill_tp it read from the worker, but /internal is an
    API and a wrong value must lose nothing)."""
    with internal_app("decode", kv_heads=4) as (c, engine):
        r = c.post("/internal/reserve", json={**RUN, "request_id": "tp3", "prefill_tp": 3})
        assert_openai_400(r)
        assert "KV head" in r.json()["error"]["message"]
        assert engine.seen == [], "a reservation was made for a layout that cannot be served"
        ok = c.post("/internal/reserve", json={**RUN, "request_id": "tp2", "prefill_tp": 2})
        assert ok.status_code == 200 and ok.json()["rank_ports"], ok.text


def test_prefill_to_decode_ranks_the_heads_cannot_split_is_400() -> None:
    """/internal/prefill whose target names 3 decode ranks for 4 KV heads: a 400 before the stream (inside
    it the connection would just break), and the engine never sees the request."""
    with internal_app("prefill", kv_heads=4) as (c, engine):
        target = {"host": "127.0.0.1", "port": 9, "rank_ports": [9, 10, 11]}
        r = c.post("/internal/prefill", json={**RUN, "request_id": "p3", "target": target})
        assert_openai_400(r)
        assert "rank_ports" in r.json()["error"]["message"]
        assert engine.seen == []


def test_valid_internal_generate_still_streams(internal: tuple[httpx.Client, DisaggFakeEngine]) -> None:
    c, _ = internal
    tok = c.post("/internal/tokenize", json={"kind": "completions", "body": {"prompt": "abc", "max_tokens": 2}})
    assert tok.status_code == 200, tok.text
    d = tok.json()
    r = c.post("/internal/generate", json={"request_id": "ok-1", "prompt_token_ids": d["prompt_token_ids"],
                                           "params": d["params"]})
    assert r.status_code == 200 and '"finished": true' in r.text, r.text


def test_internal_params_mirror_sampling_params() -> None:
    """The wire model must carry every engine field (a new one would otherwise be refused as unknown)."""
    import dataclasses

    from pdcluster.worker.api.internal import Params
    from pdcluster.worker.engine.sampling_params import SamplingParams

    assert set(Params.model_fields) == {f.name for f in dataclasses.fields(SamplingParams)}
    p = SamplingParams(max_tokens=3, temperature=0.5, stop=["x"], stop_token_ids=[1], seed=7)
    assert Params.model_validate(dataclasses.asdict(p)).to_sampling_params() == p
