"""Issue 38 on one worker, over real HTTP: each row of the attack table a client could send, answered with a
4xx that names the field, with bounded work before the engine, and never a 5xx. (The router's side is in
tests/router/test_request_failure_is_not_worker_failure.py and test_keyed_router.py; grammars in
tests/engine/test_grammar_bounds.py; the scanner and the compile pool in test_json_shape.py and
test_grammar_jobs.py.)"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from pdcluster.worker.api.api_key import install as install_api_key
from pdcluster.worker.api.grammar_jobs import GrammarJobs
from pdcluster.worker.api.json_shape import MAX_VALUES
from pdcluster.worker.api.metrics import WorkerMetrics
from pdcluster.worker.api.protocol import MAX_GUIDED_CHOICES, MAX_STOP_TOKEN_IDS
from pdcluster.worker.engine.outputs import RequestOutput
from pdcluster.worker.engine.sampling_params import SamplingParams
from pdcluster.worker.server.app import build_app
from pdcluster.worker.server.lifecycle import WorkerServer
from pdcluster.worker.server.prefix_events import prefix_events_router
from pdcluster.worker.transfer.options import TransferOptions

from .disagg_fake import DisaggFakeEngine
from .fake_engine import FakeEngine
from .harness import raw_post, serve, wait_until
from .sse import events

CHAT = [{"role": "user", "content": "hi"}]


def assert_400(r: httpx.Response, param: str | None) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    err: dict[str, Any] = r.json()["error"]
    if param is not None:
        assert err["param"] == param, r.text
    assert len(r.text) < 2000
    return err


# ---------------------------------------------------------------- rows 1, 3, 5, 6, 12: what one body may hold


def test_a_body_of_a_million_ignored_values_is_refused_before_it_is_parsed(client: httpx.Client) -> None:
    # row 3: the ignored field was parsed (a tree of 16M ints) and walked on the event loop
    raw = b'{"prompt": "a", "max_tokens": 1, "padding": [' + b"0," * MAX_VALUES + b"0]}"
    err = assert_400(client.post("/v1/completions", content=raw, headers={"content-type": "application/json"}),
                     "padding")
    assert "values" in err["message"]


def test_guided_json_string_nested_3000_deep_is_400_naming_it(client: httpx.Client) -> None:
    # row 1: a RecursionError (500) on /internal/tokenize made the router drop every worker it tried
    for path, body in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "a"})):
        r = client.post(path, json={**body, "max_tokens": 1, "guided_json": "[" * 3000 + "]" * 3000})
        assert "nested" in assert_400(r, "guided_json")["message"]


def test_tool_call_arguments_nested_3000_deep_is_400(client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 3000}}]}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert "nested" in assert_400(r, None)["message"]


def test_tokenize_messages_are_held_to_the_prompt_cap_before_the_template(client: httpx.Client) -> None:
    # row 5: /tokenize rendered 20 MB of messages (the fake model: 64 tokens -> a cap of 4096 characters)
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "x" * 5000}]})
    assert assert_400(r, "messages")["code"] == "context_length_exceeded"


def test_tool_descriptions_count_against_the_prompt_cap(client: httpx.Client) -> None:
    # row 5: the cap counted message text only; tools reach the template too
    tools = [{"type": "function", "function": {"name": "f", "description": "d" * 5000}}]
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "tools": tools, "max_tokens": 1})
    assert assert_400(r, "messages")["code"] == "context_length_exceeded"


@pytest.mark.parametrize("field,value", [("stop_token_ids", [1] * (MAX_STOP_TOKEN_IDS + 1)),
                                         ("guided_choice", ["a"] * (MAX_GUIDED_CHOICES + 1))])
def test_lists_a_request_names_are_count_capped(client: httpx.Client, field: str, value: Any) -> None:
    # row 12: a million stop_token_ids were a 5 s loop stall in the vocabulary check
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, field: value})
    assert str(len(value) - 1) in assert_400(r, field)["message"]


# ---------------------------------------------------------------- row 7: a fan-out costs its sequences


def test_a_fan_out_larger_than_the_queue_is_400_naming_n() -> None:
    app = build_app(FakeEngine(), role="decode", served_model_name="fake", max_queue_depth=4)
    with serve(app) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 1, "n": 5}, timeout=30)
        assert assert_400(r, "n")["code"] == "too_many_sequences"
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 1, "n": 4}, timeout=30)
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_admission_counts_each_sequence_against_the_queue() -> None:
    w = WorkerServer(FakeEngine(), role="decode", served_model_name="fake", metrics=WorkerMetrics("decode"),
                     max_queue_depth=4)
    w.ready = True
    w.pending = 2  # two sequences already wait
    w.admit(2)
    with pytest.raises(Exception) as e:
        w.admit(3)  # 2 + 3 > 4: the queue bound holds for a fan-out, not just per request
    assert getattr(e.value, "status", None) == 429


# ---------------------------------------------------------------- row 10: usage counts tokens


class MergingEngine(FakeEngine):
    """Every other token's text arrives with the next token (a detokenizer holding back a partial character)."""

    async def generate(self, request_id: str, prompt_token_ids: list[int],  # type: ignore[override]
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        held = ""
        async for out in super().generate(request_id, prompt_token_ids, params):
            if not out.finished and len(out.new_token_ids) and out.completion_tokens % 2:
                held += out.new_text
                out.new_text = ""
            else:
                out.new_text, held = held + out.new_text, ""
            yield out


def test_streamed_usage_counts_tokens_not_chunks() -> None:
    body = {"prompt": "a", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    with serve(build_app(MergingEngine(), role="decode", served_model_name="fake")) as url:
        plain = httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "stream_options": None},
                           timeout=30).json()
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            got = events(r)
    usage = [e for e in got if isinstance(e, dict) and e.get("usage")][-1]["usage"]
    assert plain["usage"]["completion_tokens"] == 5
    assert usage["completion_tokens"] == 5, usage


# ---------------------------------------------------------------- rows 4, 12: one auth rule


@pytest.fixture(scope="module")
def keyed() -> Iterator[str]:
    """A worker with --api-key and no KV secret, with the /internal/* and prefix-event routes mounted."""
    from pdcluster.worker.server.internal_routes import Disaggregation

    engine = DisaggFakeEngine()
    d = Disaggregation(engine, role="decode", secret=None, options=TransferOptions(backend="tcp"))
    app = build_app(engine, role="decode", served_model_name="fake", request_timeout=30,
                    routers=[d.router, prefix_events_router(engine, None)], on_startup=[d.start], on_shutdown=[d.stop])
    install_api_key(app, "K")
    with serve(app) as url:
        yield url


GENERATE = {"request_id": "r1", "prompt_token_ids": [5, 6], "params": {"max_tokens": 2}}
GUARDED = [("POST", "/internal/generate", GENERATE), ("POST", "/internal/tokenize", {"kind": "completions",
           "body": {"prompt": "a"}}), ("GET", "/internal/load", None), ("GET", "/internal/prefix-events", None),
           ("POST", "/drain", None), ("POST", "/undrain", None), ("POST", "/tokenize", {"prompt": "a"}),
           ("GET", "/openapi.json", None), ("GET", "/v1/models", None)]


@pytest.mark.parametrize("method,path,body", GUARDED, ids=[g[1] for g in GUARDED])
def test_api_key_guards_every_route_that_generates_tokenizes_drains_or_reveals(
        keyed: str, method: str, path: str, body: Any) -> None:
    r = httpx.request(method, f"{keyed}{path}", json=body, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
    assert httpx.request(method, f"{keyed}{path}", json=body, timeout=30,
                         headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_the_key_opens_them_with_bearer_in_any_case(keyed: str) -> None:
    for scheme in ("Bearer", "bearer", "BEARER"):
        r = httpx.post(f"{keyed}/internal/generate", json={**GENERATE, "request_id": f"r-{scheme}"}, timeout=30,
                       headers={"Authorization": f"{scheme} K"})
        assert r.status_code == 200, r.text
        assert json.loads(r.text.splitlines()[-1])["finished"]
    assert httpx.get(f"{keyed}/v1/models", headers={"Authorization": "bearer K"}, timeout=30).status_code == 200
    r = httpx.post(f"{keyed}/undrain", headers={"Authorization": "Bearer K"}, timeout=30)
    assert r.status_code == 200


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version"])
def test_probes_and_scrapes_stay_open(keyed: str, path: str) -> None:
    assert httpx.get(f"{keyed}{path}", timeout=30).status_code == 200


# ---------------------------------------------------------------- row 12: grammars that cannot be met, real engine


@pytest.mark.parametrize("field,value", [
    ("guided_regex", r"[^\s\S]"),
    ("guided_json", {"type": "string", "pattern": r"[^\s\S]"}),
    ("guided_json", {"type": "string", "minLength": 5, "maxLength": 2}),
    ("guided_json", json.dumps({"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 1})),
])
def test_a_grammar_no_output_can_meet_is_400_before_any_token(real_client: httpx.Client, field: str,
                                                              value: Any) -> None:
    # the regex case was a 500 from the engine (no token allowed) and a 502 after three retries via the router
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        r = real_client.post(path, json={**body, "max_tokens": 4, field: value})
        assert_400(r, field)


# ---------------------------------------------------------------- row 2: a compile queued for a client that left


class CompilingEngine(FakeEngine):
    """compile_grammar blocks until the test releases it and records which regexes it compiled."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.compiled: list[str] = []

    def compile_grammar(self, params: SamplingParams) -> None:
        self.compiled.append(params.structured_spec)
        assert self.release.wait(30), "never released"


def test_a_compile_queued_for_a_client_that_left_never_runs() -> None:
    engine = CompilingEngine()
    app = build_app(engine, role="decode", served_model_name="fake")
    jobs = app.state.worker.grammar_jobs = GrammarJobs(threads=1)
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(c.post, "/v1/completions", json={"prompt": "a", "max_tokens": 1, "guided_regex": "a"})
            assert wait_until(lambda: engine.compiled == ["a"])  # holds the only grammar thread
            left = raw_post(url, "/v1/completions", {"prompt": "a", "max_tokens": 1, "guided_regex": "b"})
            assert wait_until(lambda: jobs.queued == 1)  # waits behind it
            left.close()  # the client goes: its compile is abandoned before it starts
            assert wait_until(lambda: jobs.queued == 0)
            plain = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
            assert plain.status_code == 200  # and plain requests never waited for any of it
            engine.release.set()
            assert first.result().status_code == 200
        jobs.pool.submit(lambda: None).result(timeout=30)  # the grammar thread has passed the abandoned job
    assert engine.compiled == ["a"]


class DeadEndEngine(FakeEngine):
    """Fails every request the way the engine does when a request's grammar leaves no token to take."""

    async def generate(self, request_id: str, prompt_token_ids: list[int],  # type: ignore[override]
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        yield RequestOutput(request_id, [], "", True, "error", len(prompt_token_ids), 0,
                            error="ValueError: token 0 does not fit the request's grammar")


def test_a_grammar_dead_end_is_400_on_every_path_not_a_worker_failure() -> None:
    from pdcluster.worker.server.internal_routes import Disaggregation

    class Engine(DeadEndEngine, DisaggFakeEngine):
        pass

    engine = Engine()
    d = Disaggregation(engine, role="decode", secret=None, options=TransferOptions(backend="tcp"))
    with serve(build_app(engine, role="decode", served_model_name="fake", routers=[d.router])) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "grammar_dead_end", r.text
        line = httpx.post(f"{url}/internal/generate", json=GENERATE, timeout=30).text.splitlines()[-1]
        assert json.loads(line)["status"] == 400  # the router passes a 4xx line on, unretried
