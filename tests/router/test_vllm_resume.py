"""The bookkeeping behind a vLLM stream's resume (router/vllm_resume.py), on events in vLLM's own format: which
tokens the client has, the next leg's body, and that leg's events rewritten into the client's stream. The resume
itself, with real vLLM workers and a killed decode worker, is tests/local/test_up_vllm_resume.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdcluster.worker.router.vllm_resume import StreamState, blocker


def _ev(text: str, ids: list[int] | None, finish: str | None = None, rid: str = "cmpl-a", **kw: Any) -> str:
    ch = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
          "prompt_token_ids": None, "token_ids": ids}
    return "data: " + json.dumps({"id": rid, "object": "text_completion", "created": 7, "model": "tiny",
                                  "choices": [ch], **kw}, separators=(",", ":"))


def _data(line: str | None) -> dict[str, Any]:
    assert line is not None and line.startswith("data: ")
    return json.loads(line[6:])  # type: ignore[no-any-return]


@pytest.mark.parametrize(("kind", "body", "why"), [
    ("completions", {"n": 2}, "n > 1"),
    ("completions", {"stop": ["\n"]}, "stop strings"),
    ("completions", {"logprobs": 2}, "logprobs"),
    ("chat", {"logprobs": True}, "logprobs"),
    ("chat", {"response_format": {"type": "json_object"}}, "structured output"),
    ("completions", {"guided_regex": "a+"}, "structured output"),
    ("chat", {"tools": [{"type": "function"}]}, "tool calls"),
    ("completions", {"prompt": ["a", "b"]}, "several prompts"),
    ("completions", {"prompt": [1, 2, 3], "stop": []}, None),
    ("chat", {"tools": [{"type": "function"}], "tool_choice": "none", "logprobs": False}, None),
])
def test_what_cannot_be_resumed(kind: str, body: dict[str, Any], why: str | None) -> None:
    assert blocker(kind, body) == why


def test_a_completions_stream_resumes_after_the_tokens_sent() -> None:
    st = StreamState("completions", {"model": "tiny", "prompt": "hi", "max_tokens": 5, "min_tokens": 3,
                                     "echo": True, "temperature": 0, "stream": True,
                                     "stream_options": {"include_usage": True}}, [1, 2])
    assert st.leg_body()["return_token_ids"] is True
    out, n = st.line(_ev(" a", [10]))
    assert n == 1 and _data(out)["choices"][0]["token_ids"] is None  # asked for by the router, hidden again
    st.line(_ev(" b", [11]))
    assert st.line("") == ("", 0)
    assert (st.sent, st.finished, st.all_sent()) == ([10, 11], False, False)
    st.start_leg()
    nxt = st.resume_body()
    assert nxt["prompt"] == [1, 2, 10, 11] and nxt["max_tokens"] == 3 and nxt["min_tokens"] == 1
    assert "echo" not in nxt and nxt["stream"] is True and nxt["temperature"] == 0
    out, n = st.line(_ev(" c", [12], rid="cmpl-b"))
    ev = _data(out)
    assert n == 1 and (ev["id"], ev["choices"][0]["text"], ev["choices"][0]["token_ids"]) == ("cmpl-a", " c", None)
    usage = _data("data: " + json.dumps({"id": "cmpl-b", "object": "text_completion", "created": 9, "model": "tiny",
                                         "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3,
                                                                  "total_tokens": 7}}))
    out, _ = st.line("data: " + json.dumps(usage))
    assert _data(out)["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
    assert st.line("data: [DONE]") == ("data: [DONE]", 0) and st.done


def test_a_chat_stream_resumes_as_chat_chunks() -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4,
            "stream": True, "return_token_ids": True, "temperature": 0}
    st = StreamState("chat", body, [5, 6, 7])
    assert st.leg_body() is body  # the client asked for token ids itself: relayed as they are
    first = "data: " + json.dumps({"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 3,
                                   "model": "tiny", "choices": [{"index": 0, "delta": {"content": "x"},
                                                                 "finish_reason": None, "token_ids": [40]}]})
    assert st.line(first) == (first, 1)
    st.start_leg()
    nxt = st.resume_body()
    assert nxt == {"model": "tiny", "temperature": 0, "prompt": [5, 6, 7, 40], "stream": True,
                   "return_token_ids": True, "max_tokens": 3}
    ev = _data(st.line(_ev("y", [41, 42], finish="length", rid="cmpl-b"))[0])
    assert ev["id"] == "chatcmpl-a" and ev["object"] == "chat.completion.chunk" and ev["created"] == 3
    assert ev["choices"] == [{"index": 0, "delta": {"content": "y"}, "logprobs": None, "finish_reason": "length",
                              "stop_reason": None, "token_ids": [41, 42]}]
    assert st.sent == [40, 41, 42] and st.finished


def test_a_break_after_the_last_token_only_closes_the_stream() -> None:
    st = StreamState("completions", {"prompt": "hi", "max_tokens": 2, "stream": True}, [1])
    st.line(_ev("a", [3]))
    st.line(_ev("b", [4]))  # the last token, its finish_reason lost with the worker
    assert st.all_sent() and not st.finished
    closing = st.closing()
    assert _data(closing[0])["choices"] == [{"index": 0, "finish_reason": "length", "text": ""}]
    assert closing[-2:] == ["data: [DONE]", ""]


def test_a_blocked_stream_is_relayed_untouched() -> None:
    st = StreamState("completions", {"prompt": "hi", "stop": ["x"], "stream": True}, [1])
    assert "return_token_ids" not in st.leg_body()
    line = _ev("a", None)
    assert st.line(line) == (line, 1) and st.sent == []


def test_a_leg_from_a_character_boundary_does_not_send_tokens_twice() -> None:
    # the last two tokens sent are bytes of one unfinished character: the next leg starts before them, and the
    # two come again (greedy) before anything new
    st = StreamState("completions", {"prompt": "hi", "max_tokens": 6, "stream": True}, [1])
    for i, t in enumerate((20, 21, 22)):
        st.line(_ev("ab"[i % 2], [t]))
    st.start_leg(clean=1)
    nxt = st.resume_body()
    assert nxt["prompt"] == [1, 20] and nxt["max_tokens"] == 5
    assert st.line(_ev("\ufffd", [21], rid="cmpl-b")) == (None, 0)
    assert st.line(_ev("\ufffd", [22], rid="cmpl-b")) == (None, 0)
    out, n = st.line(_ev("c", [23], rid="cmpl-b"))
    assert n == 1 and _data(out)["choices"][0]["text"] == "c" and st.sent == [20, 21, 22, 23]
    usage = {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
    out, _ = st.line("data: " + json.dumps({"id": "cmpl-b", "object": "text_completion", "created": 9,
                                            "model": "tiny", "choices": [], "usage": usage}))
    assert _data(out)["usage"] == {"prompt_tokens": 1, "completion_tokens": 6, "total_tokens": 7}
