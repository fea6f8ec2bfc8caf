"""The OpenAI endpoints over real HTTP against the fake engine: shapes, streaming, extensions."""

from __future__ import annotations

import httpx

from .sse import events


def test_completion_text_prompt(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"model": "fake", "prompt": "hello", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "fake"
    assert body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] == "abcde" and choice["finish_reason"] == "length" and choice["index"] == 0
    assert "token_ids" not in choice
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}


def test_completion_token_ids_and_return_token_ids(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == [ord("b"), ord("c"), ord("d")]
    assert choice["text"] == "bcd"
    assert r.json()["usage"]["prompt_tokens"] == 3


def test_single_prompt_in_a_list_is_accepted(client: httpx.Client) -> None:
    assert client.post("/v1/completions", json={"prompt": ["hi"], "max_tokens": 1}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": [[5, 6]], "max_tokens": 1}).status_code == 200


def test_stop_string_finishes_with_stop(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 20, "stop": "e"})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert "e" not in choice["text"]


def test_streaming_completion(client: httpx.Client) -> None:
    body = {"prompt": "hello", "max_tokens": 4, "stream": True, "return_token_ids": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        evs = events(r)
    assert evs[-1] == "[DONE]"
    chunks = evs[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abcd"
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == [ord(x) for x in "abcd"]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert all("usage" not in c for c in chunks)  # only when asked for (stream_options.include_usage)
    with client.stream("POST", "/v1/completions", json={**body, "stream_options": {"include_usage": True}}) as r:
        asked = events(r)[:-1]
    # OpenAI's shape: one more chunk, with no choices and the usage
    assert asked[-1]["choices"] == [] and asked[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 4,
                                                                  "total_tokens": 9}
    assert all("usage" not in c for c in asked[:-1]) and asked[-2]["choices"][0]["finish_reason"] == "length"


def test_chat_completion_uses_template(client: httpx.Client) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"]) == 3 and choice["finish_reason"] == "length"
    # The fake tokenizer's template renders "<system>be brief<user>hi<assistant>" -> one token per char.
    assert body["usage"]["prompt_tokens"] == len("<system>be brief<user>hi<assistant>")


def test_chat_max_tokens_defaults_to_remaining_context(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200
    usage = r.json()["usage"]
    assert usage["total_tokens"] == 64  # the fake model's max length


def test_streaming_chat(client: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        evs = events(r)
    assert evs[-1] == "[DONE]"
    chunks = evs[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert len(text) == 3
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_models_endpoint(client: httpx.Client) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["fake"]
    assert body["data"][0]["max_model_len"] == 64


def test_unknown_model_is_404_openai_shaped(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"


def test_unknown_route_is_openai_shaped(client: httpx.Client) -> None:
    r = client.get("/v1/nope")
    assert r.status_code == 404
    assert set(r.json()["error"]) >= {"message", "type", "code"}


def test_unknown_fields_are_ignored(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "user": "u", "frequency_penalty": 0})
    assert r.status_code == 200
