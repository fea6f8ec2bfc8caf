"""Every invalid input is a 400 with an OpenAI error body (never 422), and the server keeps serving."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

COMPLETION_CASES: list[tuple[str, Any]] = [
    ("missing prompt", {}),
    ("prompt is a number", {"prompt": 5}),
    ("prompt is an object", {"prompt": {"a": 1}}),
    ("prompt mixes ids and text", {"prompt": [1, "a"]}),
    ("prompt has float ids", {"prompt": [1.5]}),
    ("prompt has bool ids", {"prompt": [True]}),
    ("empty text prompt", {"prompt": ""}),
    ("empty id prompt", {"prompt": []}),
    ("token id above vocab", {"prompt": [1, 128]}),
    ("negative token id", {"prompt": [-1]}),
    ("max_tokens 0", {"prompt": "a", "max_tokens": 0}),
    ("max_tokens negative", {"prompt": "a", "max_tokens": -3}),
    ("max_tokens string", {"prompt": "a", "max_tokens": "5"}),
    ("max_tokens float", {"prompt": "a", "max_tokens": 1.5}),
    ("max_tokens bool", {"prompt": "a", "max_tokens": True}),
    ("prompt + max_tokens too long", {"prompt": "a" * 10, "max_tokens": 60}),
    ("prompt alone too long", {"prompt": [1] * 65, "max_tokens": 1}),
    ("negative temperature", {"prompt": "a", "temperature": -0.1}),
    ("temperature string", {"prompt": "a", "temperature": "hot"}),
    ("top_p zero", {"prompt": "a", "top_p": 0}),
    ("top_p above one", {"prompt": "a", "top_p": 1.5}),
    ("top_k below -1", {"prompt": "a", "top_k": -2}),
    ("stop is a number", {"prompt": "a", "stop": 5}),
    ("empty stop string", {"prompt": "a", "stop": [""]}),
    ("stop token id out of vocab", {"prompt": "a", "stop_token_ids": [1000]}),
    ("stream not a bool", {"prompt": "a", "stream": "yes"}),
    ("seed not an int", {"prompt": "a", "seed": "x"}),
    ("seed too large", {"prompt": "a", "seed": 2**64}),
    ("n 0", {"prompt": "a", "n": 0}),
    ("n too large", {"prompt": "a", "n": 129}),
    ("prompts x n too large", {"prompt": ["a"] * 20, "n": 7}),
    ("a batch with an empty prompt", {"prompt": ["a", ""]}),
    ("a batch with a bad id list", {"prompt": [[1, 2], [1.5]]}),
    ("a batch with an id out of vocab", {"prompt": [[1, 2], [1, 500]]}),
    ("presence_penalty above 2", {"prompt": "a", "presence_penalty": 2.5}),
    ("frequency_penalty below -2", {"prompt": "a", "frequency_penalty": -3}),
    ("repetition_penalty 0", {"prompt": "a", "repetition_penalty": 0}),
    ("min_tokens negative", {"prompt": "a", "min_tokens": -1}),
    ("min_tokens above max_tokens", {"prompt": "a", "max_tokens": 2, "min_tokens": 3}),
    ("logit_bias key not a token id", {"prompt": "a", "logit_bias": {"x": 1}}),
    ("logit_bias value above 100", {"prompt": "a", "logit_bias": {"5": 101}}),
    ("logit_bias id out of vocab", {"prompt": "a", "logit_bias": {"1000": 1}}),
    ("logprobs above 20", {"prompt": "a", "logprobs": 21}),
    ("logprobs a bool", {"prompt": "a", "logprobs": True}),
    ("echo with logprobs", {"prompt": "a", "echo": True, "logprobs": 1}),
    ("suffix", {"prompt": "a", "suffix": "z"}),
    ("best_of above n", {"prompt": "a", "best_of": 2}),
]

CHAT_CASES: list[tuple[str, Any]] = [
    ("missing messages", {}),
    ("no messages", {"messages": []}),
    ("messages not a list", {"messages": "hi"}),
    ("unknown role", {"messages": [{"role": "robot", "content": "x"}]}),
    ("content a number", {"messages": [{"role": "user", "content": 5}]}),
    ("image content", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
    ("max_tokens 0", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
    ("max_completion_tokens too long", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 999}),
    ("top_logprobs without logprobs", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
    ("logprobs an int", {"messages": [{"role": "user", "content": "x"}], "logprobs": 2}),
    ("top_logprobs above 20", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}),
    ("chat echo", {"messages": [{"role": "user", "content": "x"}], "echo": True}),
    ("n 0", {"messages": [{"role": "user", "content": "x"}], "n": 0}),
]


def assert_openai_400(r: httpx.Response) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error"
    assert "code" in err


@pytest.mark.parametrize("body", [c[1] for c in COMPLETION_CASES], ids=[c[0] for c in COMPLETION_CASES])
def test_bad_completion_is_400(client: httpx.Client, body: Any) -> None:
    assert_openai_400(client.post("/v1/completions", json=body))


@pytest.mark.parametrize("body", [c[1] for c in CHAT_CASES], ids=[c[0] for c in CHAT_CASES])
def test_bad_chat_is_400(client: httpx.Client, body: Any) -> None:
    assert_openai_400(client.post("/v1/chat/completions", json=body))


@pytest.mark.parametrize(
    "content", [b"{not json", b"[1, 2]", b"", b'"just a string"', b"\xff\xfe"], ids=["broken", "array", "empty", "string", "binary"]
)
def test_malformed_body_is_400(client: httpx.Client, content: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert_openai_400(client.post(path, content=content, headers={"content-type": "application/json"}))


def test_nan_is_400(client: httpx.Client) -> None:
    body = b'{"prompt": "a", "temperature": NaN}'
    assert_openai_400(client.post("/v1/completions", content=body, headers={"content-type": "application/json"}))


def test_server_keeps_serving_after_bad_inputs(client: httpx.Client) -> None:
    for _, body in COMPLETION_CASES:
        client.post("/v1/completions", json=body)
    r = client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200
    assert len(r.json()["choices"][0]["text"]) == 2
    assert client.get("/health").status_code == 200
    metrics = client.get("/metrics").text
    invalid = [ln for ln in metrics.splitlines() if ln.startswith("pdcluster_requests_rejected_total") and "invalid" in ln]
    assert invalid and float(invalid[0].split()[-1]) >= len(COMPLETION_CASES)
