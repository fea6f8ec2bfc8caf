"""The OpenAI surface with the official `openai` client, on both paths: a worker alone and router -> prefill ->
KV transfer -> decode. Every feature must give the same answer on both for the same seed (penalties, bias,
min_tokens, logprobs, n > 1, batched prompts, echo, usage chunk)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from ..disagg.harness import Cluster, cluster, metric

IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def paths(tiny_model_dir: Path) -> Iterator[tuple[Any, Any, Cluster]]:
    """(worker-alone client, router client, cluster): the decode worker serves the API itself too."""
    with cluster(tiny_model_dir, prefill_blocks=(8,), decode_blocks=(16,), threshold=0) as c:
        alone = openai.OpenAI(base_url=c.decode[0] + "/v1", api_key="x", max_retries=0, timeout=60)
        routed = openai.OpenAI(base_url=c.router + "/v1", api_key="x", max_retries=0, timeout=60)
        yield alone, routed, c


def _choices(resp: Any) -> list[dict[str, Any]]:
    return [c.model_dump() for c in resp.choices]


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x["index"], x.get("text"), x.get("token_ids"), x["finish_reason"]) == (
            y["index"], y.get("text"), y.get("token_ids"), y["finish_reason"])
        if x.get("logprobs"):
            lx, ly = x["logprobs"], y["logprobs"]
            assert lx["tokens"] == ly["tokens"] and lx["text_offset"] == ly["text_offset"]
            assert lx["token_logprobs"] == pytest.approx(ly["token_logprobs"], abs=1e-3)


COMPLETION_BODIES: list[tuple[str, dict[str, Any]]] = [
    ("seeded penalties", {"prompt": "the cat sat on", "max_tokens": 8, "temperature": 0.9, "seed": 7,
                          "presence_penalty": 0.5, "frequency_penalty": 0.7,
                          "extra_body": {"repetition_penalty": 1.3, "ignore_eos": True, **IDS}}),
    ("greedy logit_bias", {"prompt": "hello", "max_tokens": 5, "temperature": 0, "logit_bias": {"42": 100},
                           "extra_body": IDS}),
    ("n=3 seeded", {"prompt": "once upon", "max_tokens": 6, "n": 3, "seed": 11, "temperature": 1.0,
                    "extra_body": {"ignore_eos": True, **IDS}}),
    ("batched prompts x n=2", {"prompt": ["one", "two three"], "n": 2, "max_tokens": 4, "seed": 3,
                               "extra_body": {"ignore_eos": True, **IDS}}),
    ("logprobs", {"prompt": "abc", "max_tokens": 5, "temperature": 0, "logprobs": 3,
                  "extra_body": {"ignore_eos": True, **IDS}}),
    ("echo", {"prompt": "echo me", "max_tokens": 3, "temperature": 0, "echo": True, "extra_body": IDS}),
]


@pytest.mark.parametrize("body", [b for _, b in COMPLETION_BODIES], ids=[n for n, _ in COMPLETION_BODIES])
def test_completions_same_on_both_paths(paths: tuple[Any, Any, Cluster], body: dict[str, Any]) -> None:
    alone, routed, c = paths
    sent = metric(c.prefill[0], "pdcluster_kv_transfer_bytes_total")
    a = alone.completions.create(model="tiny", **body)
    b = routed.completions.create(model="tiny", **body)
    assert metric(c.prefill[0], "pdcluster_kv_transfer_bytes_total") > sent  # the router path did disaggregate
    _same(_choices(a), _choices(b))
    assert a.usage == b.usage
    n_prompts = len(body["prompt"]) if isinstance(body["prompt"], list) else 1
    assert len(a.choices) == n_prompts * body.get("n", 1)
    assert [c.index for c in a.choices] == list(range(len(a.choices)))


def test_streams_equal_non_streamed_on_both_paths(paths: tuple[Any, Any, Cluster]) -> None:
    alone, routed, _ = paths
    body = {"prompt": ["x y", "z"], "n": 2, "max_tokens": 5, "seed": 5, "extra_body": {"ignore_eos": True, **IDS}}
    want = _choices(alone.completions.create(model="tiny", **body))
    for client in (alone, routed):
        text: dict[int, str] = {}
        reasons: dict[int, str] = {}
        usage = None
        for chunk in client.completions.create(model="tiny", stream=True, stream_options={"include_usage": True},
                                               **body):
            if not chunk.choices:
                usage = chunk.usage  # the usage chunk: last, and without choices
                continue
            assert chunk.usage is None
            c = chunk.choices[0]
            text[c.index] = text.get(c.index, "") + c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
        assert [text[i] for i in range(4)] == [w["text"] for w in want]
        assert [reasons[i] for i in range(4)] == [w["finish_reason"] for w in want]
        assert usage is not None and usage.completion_tokens == 20
    # without include_usage, no usage chunk at all
    chunks = list(alone.completions.create(model="tiny", prompt="a", max_tokens=2, stream=True))
    assert all(c.choices and c.usage is None for c in chunks)


def test_chat_n_and_logprobs_same_on_both_paths(paths: tuple[Any, Any, Cluster]) -> None:
    alone, routed, _ = paths
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2, "seed": 9,
            "logprobs": True, "top_logprobs": 2, "extra_body": {"ignore_eos": True, **IDS}}
    a, b = alone.chat.completions.create(model="tiny", **body), routed.chat.completions.create(model="tiny", **body)
    for x, y in zip(a.choices, b.choices, strict=True):
        assert x.message.content == y.message.content and x.index == y.index
        assert [t.token for t in x.logprobs.content] == [t.token for t in y.logprobs.content]
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in x.logprobs.content)
    assert a.choices[0].message.content != a.choices[1].message.content or a.choices[0].index != 1


def test_logit_bias_forces_a_token(paths: tuple[Any, Any, Cluster]) -> None:
    alone, routed, _ = paths
    for client in (alone, routed):
        r = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0.8, seed=1,
                                      logit_bias={"42": 100}, extra_body=IDS)
        assert r.model_dump()["choices"][0]["token_ids"] == [42] * 4


def test_min_tokens_holds_back_a_stop_token(paths: tuple[Any, Any, Cluster]) -> None:
    alone, routed, _ = paths
    greedy = {"prompt": "stop here", "max_tokens": 6, "temperature": 0}
    first = alone.completions.create(model="tiny", **greedy, extra_body=IDS).model_dump()["choices"][0]["token_ids"][0]
    for client in (alone, routed):
        stopped = client.completions.create(model="tiny", **greedy, extra_body={"stop_token_ids": [first], **IDS})
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.model_dump()["choices"][0]["token_ids"] == [first]
        held = client.completions.create(model="tiny", **greedy,
                                         extra_body={"stop_token_ids": [first], "min_tokens": 3, **IDS})
        ids = held.model_dump()["choices"][0]["token_ids"]
        assert len(ids) >= 3 and first not in ids[:3]


def test_bad_fields_are_openai_errors(paths: tuple[Any, Any, Cluster]) -> None:
    alone, routed, _ = paths
    for client in (alone, routed):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="a", max_tokens=1, extra_body={"guided_grammar": "a+"})
        assert e.value.body["param"] == "guided_grammar"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt="a", max_tokens=1, logit_bias={"100000": 1})


def test_tokenize_detokenize_version_and_model_card(paths: tuple[Any, Any, Cluster]) -> None:
    import httpx

    _, routed, c = paths
    for base in (c.decode[0], c.router):
        t = httpx.post(f"{base}/tokenize", json={"prompt": "hello world"}, timeout=30).json()
        assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] == 1024
        back = httpx.post(f"{base}/detokenize", json={"tokens": t["tokens"]}, timeout=30).json()
        assert "hello world" in back["prompt"]
        chat = httpx.post(f"{base}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert chat.status_code == 200 and chat.json()["count"] > 0
        bad = httpx.post(f"{base}/detokenize", json={"tokens": [10**6]}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        assert httpx.get(f"{base}/version", timeout=30).json()["version"]
        missing = httpx.get(f"{base}/no/such/route", timeout=30)
        err = missing.json()["error"]
        assert missing.status_code == 404 and err["code"] == "unknown_route" and "/no/such/route" in err["message"]
    assert routed.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        routed.models.retrieve("gpt-4")


def test_api_key_on_the_router() -> None:
    from pdcluster.worker.router.app import RouterState, build_router_app
    from pdcluster.worker.router.options import RouterOptions
    from pdcluster.worker.router.pool import Pool

    from ..netutil import serve

    state = RouterState(Pool(prefill_urls=[], decode_urls=[], interval=60),
                        RouterOptions(max_queue_depth=0, disaggregation_threshold=0, request_timeout=5, max_retries=0))
    with serve(build_router_app(state, api_key="sekret")) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            c.completions.create(model="tiny", prompt="a", max_tokens=1)
        assert e.value.body["code"] == "invalid_api_key"  # type: ignore[index]
        import httpx

        assert httpx.post(f"{url}/v1/completions", json={"prompt": "a"}, timeout=5).status_code == 401  # no key
        ok = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:  # past the key check: 503, no workers
            ok.completions.create(model="tiny", prompt="a", max_tokens=1)
        assert e.value.status_code == 503
        assert httpx.get(f"{url}/live", timeout=5).status_code == 200  # probes need no key


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z ]{1,6}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}, "ok": {"type": "boolean"}}}


def _fits(obj: Any) -> bool:
    import re

    return (isinstance(obj, dict) and set(obj) == {"name", "age", "ok"} and isinstance(obj["name"], str)
            and re.fullmatch("[a-z ]{1,6}", obj["name"]) is not None and type(obj["age"]) is int
            and 0 <= obj["age"] <= 120 and isinstance(obj["ok"], bool))


def test_structured_output_same_on_both_paths(paths: tuple[Any, Any, Cluster]) -> None:
    """response_format json_schema (chat) and guided_json / guided_regex / guided_choice (completions): the
    output follows the grammar, and the router path (first token on the prefill worker, the matcher rebuilt
    on the decode worker) gives the same tokens for the same seed."""
    import json
    import re

    alone, routed, _ = paths
    chat = {"messages": [{"role": "user", "content": "who?"}], "max_tokens": 60, "seed": 4, "temperature": 0.9,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}
    a, b = alone.chat.completions.create(model="tiny", **chat), routed.chat.completions.create(model="tiny", **chat)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert _fits(json.loads(a.choices[0].message.content)) and a.choices[0].finish_reason == "stop"
    cases = [({"guided_json": SCHEMA}, lambda t: _fits(json.loads(t))),
             ({"guided_regex": "[a-c]{3}-[0-9]{2,4}"}, lambda t: re.fullmatch("[a-c]{3}-[0-9]{2,4}", t)),
             ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue"))]
    for extra, ok in cases:
        body = {"prompt": "say:", "max_tokens": 60, "n": 2, "seed": 8, "extra_body": {**extra, **IDS}}
        x, y = alone.completions.create(model="tiny", **body), routed.completions.create(model="tiny", **body)
        _same(_choices(x), _choices(y))
        assert all(ok(c.text) and c.finish_reason == "stop" for c in x.choices), (extra, x.choices)
    # json_object: a JSON object (greedy here: a random model's object can be long)
    r = routed.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=80,
                                       temperature=0, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_bad_grammars_are_400s_naming_the_field(paths: tuple[Any, Any, Cluster]) -> None:
    alone, routed, _ = paths
    bad: list[tuple[str, dict[str, Any]]] = [
        ("guided_regex", {"extra_body": {"guided_regex": "a("}}),
        ("guided_json", {"extra_body": {"guided_json": {"type": "nope"}}}),
        ("guided_json", {"extra_body": {"guided_json": "{not json"}}),
        ("guided_choice", {"extra_body": {"guided_choice": []}}),
        ("guided_choice", {"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}),
        ("response_format", {"extra_body": {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"properties": {"a": {"$ref": "#/missing"}}}}}}}),
    ]
    for client in (alone, routed):
        for param, extra in bad:
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(model="tiny", prompt="a", max_tokens=4, **extra)
            assert e.value.body["param"] == param, (param, e.value.body)  # type: ignore[index]
            assert ".cc:" not in e.value.body["message"]  # type: ignore[index]


def test_tools_and_chat_template_kwargs_reach_the_template(real_engine: Any, real_url: str) -> None:
    """tools and chat_template_kwargs are template variables (the prompt grows by exactly what the template
    renders from them); tool_choice "auto" on a worker without --tool-call-parser is a 400 naming tool_choice."""
    tok = real_engine.tokenizer
    saved = tok.chat_template
    tok.chat_template = ("{% if tools %}[{{ tools[0]['function']['name'] }}]{% endif %}{{ messages[-1]['content'] }}"
                         "{% if mood is defined %}<{{ mood }}>{% endif %}")
    try:
        client = openai.OpenAI(base_url=real_url + "/v1", api_key="x", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "weather?"}]
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
        r = client.chat.completions.create(model="demo", messages=msgs, max_tokens=1, tools=tools,
                                           extra_body={"chat_template_kwargs": {"mood": "sunny"}})
        assert r.usage.prompt_tokens == len(tok.encode("[get_weather]weather?<sunny>", add_special_tokens=False))
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="demo", messages=msgs, max_tokens=1, tools=tools, tool_choice="auto")
        assert e.value.body["param"] == "tool_choice"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="demo", messages=msgs, max_tokens=1,
                                           extra_body={"chat_template_kwargs": {"messages": []}})
        assert e.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as e:  # tools on completions: nothing to render them into
            client.completions.create(model="demo", prompt="a", max_tokens=1, extra_body={"tools": tools})
        assert e.value.body["param"] == "tools"  # type: ignore[index]
    finally:
        tok.chat_template = saved


def test_tools_accepted_on_both_paths(paths: tuple[Any, Any, Cluster]) -> None:
    alone, routed, _ = paths
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "tools": tools,
            "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    a, b = alone.chat.completions.create(model="tiny", **body), routed.chat.completions.create(model="tiny", **body)
    assert a.choices[0].message.content == b.choices[0].message.content and a.usage == b.usage
