"""Tool calls without a model: the parser (api/tool_calls.py) split every way a stream can split it agrees with
the whole-text parse, the request rules (bad tool definitions and tool_choice values are 400s naming the field),
and the Hermes `auto` path over HTTP with the official `openai` client, streamed and not, on a scripted engine
whose output is a known text."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest

from pdcluster.worker.api.shaping import ChoiceResult, Shaper
from pdcluster.worker.api.tool_calls import ToolCallStream, ToolPlan, merge_deltas, parse_whole
from pdcluster.worker.engine.outputs import RequestOutput
from pdcluster.worker.engine.sampling_params import SamplingParams
from pdcluster.worker.server.app import build_app

from .fake_engine import FakeEngine
from .harness import serve

HERMES = ToolPlan("auto", parser="hermes")
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
ARGS = '{"city": "Paris", "unit": "c"}'


def _streamed(plan: ToolPlan, pieces: list[str]) -> tuple[str | None, list[dict[str, Any]] | None]:
    s = ToolCallStream(plan)
    deltas = [d for p in pieces for d in s.feed(p)] + s.finish()
    return merge_deltas(deltas)


def _splits(text: str) -> Iterator[list[str]]:
    yield [text]
    yield list(text)  # a character per token
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]


def _calls(calls: list[dict[str, Any]] | None) -> list[tuple[str, str]]:
    assert calls is not None
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


HERMES_CASES: list[tuple[str, str | None, list[tuple[str, str]]]] = [
    (f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>\n", "Let me check.", [("get_weather", ARGS)]),
    (f"<tool_call>{CALL}</tool_call><tool_call>{{\"name\": \"f\", \"arguments\": {{}}}}</tool_call>", None,
     [("get_weather", ARGS), ("f", "{}")]),
    (f"a\n<tool_call>{CALL}</tool_call>\nb  ", "a\n\nb", [("get_weather", ARGS)]),  # text on both sides
    (f"<tool_call>{CALL}", None, [("get_weather", ARGS)]),  # unclosed at the end, but whole JSON
    ("no calls here <b> 1 < 2  ", "no calls here <b> 1 < 2  ", []),  # untouched without calls
    ("<tool_call>{not json</tool_call> ok", "<tool_call>{not json</tool_call> ok", []),  # not a call: text
    ("cut <tool_ca", "cut <tool_ca", []),  # a partial tag held back, then given back at the end
]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES, ids=range(len(HERMES_CASES)))
def test_hermes_stream_agrees_with_whole(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    whole = parse_whole(HERMES, text)
    assert whole[0] == content
    assert (_calls(whole[1]) if calls else whole[1]) == (calls or None)
    for pieces in _splits(text):
        got = _streamed(HERMES, pieces)
        assert got[0] == content, pieces
        assert (_calls(got[1]) if calls else got[1]) == (calls or None), pieces


def test_required_and_named_streams_agree_with_whole() -> None:
    required = ToolPlan("required")
    for pieces in _splits(CALL):
        assert _streamed(required, pieces)[0] is None
        assert _calls(_streamed(required, pieces)[1]) == [("get_weather", ARGS)], pieces
    named = ToolPlan("named", "get_weather")
    for pieces in _splits(ARGS):
        assert _calls(_streamed(named, pieces)[1]) == [("get_weather", ARGS)]
    # cut by max_tokens: the arguments as far as they got; before the name is whole, the text is content
    assert _calls(parse_whole(required, CALL[:40])[1]) == [("get_weather", CALL[CALL.index("{", 1):40])]
    assert parse_whole(required, CALL[:12]) == (CALL[:12], None)
    assert _calls(parse_whole(named, "")[1]) == [("get_weather", "")]


def test_a_call_keeps_one_id_across_its_stream_items() -> None:
    s = ToolCallStream(ToolPlan("named", "f"))
    items = [d for p in ("{", '"a"', ": 1}") for kind, d in s.feed(p)] + [d for _, d in s.finish()]
    assert "id" in items[0] and items[0]["function"]["name"] == "f"
    assert all(set(i) == {"index", "function"} and set(i["function"]) == {"arguments"} for i in items[1:])


def _events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]


def test_shaper_streams_what_it_returns_whole() -> None:
    """The SSE chunks a client accumulates equal the non-streamed message; the finish reason is tool_calls."""
    text = f"ok <tool_call>{CALL}</tool_call>"
    shape = Shaper("chat", "m", 3, tools=HERMES, return_token_ids=True)
    chunks = [shape.chunk(ch, [i], None) for i, ch in enumerate(text[:-1])] + [shape.chunk(text[-1], [99], "stop")]
    events = [e for c in chunks for e in _events(c)]
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    items = [t for e in events for t in e["choices"][0]["delta"].get("tool_calls") or []]
    assert content == "ok" and items[0]["function"]["name"] == "get_weather"
    assert "".join(t["function"]["arguments"] for t in items) == ARGS
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]] == ["tool_calls"]
    assert sum(len(e["choices"][0].get("token_ids") or []) for e in events) == len(text)  # no token id lost
    body = Shaper("chat", "m", 3, tools=HERMES).final([ChoiceResult(0, text, [1], "stop")], 1)
    msg = body["choices"][0]
    assert msg["message"]["content"] == "ok" and msg["finish_reason"] == "tool_calls"
    assert _calls(msg["message"]["tool_calls"]) == [("get_weather", ARGS)]
    cut = Shaper("chat", "m", 3, tools=ToolPlan("named", "f")).final([ChoiceResult(0, '{"a', [1], "length")], 1)
    assert cut["choices"][0]["finish_reason"] == "length" and cut["choices"][0]["message"]["content"] is None


# ---------------------------------------------------------------- over HTTP


class ScriptEngine(FakeEngine):
    """Writes `script` a character per token (the fake tokenizer's ids are character codes)."""

    script = f"Checking.\n<tool_call>\n{CALL}\n</tool_call>"

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        params.validate()
        n = len(prompt_token_ids)
        out = self.script[:params.max_tokens]
        for i, ch in enumerate(out):
            last = i == len(out) - 1
            reason = ("stop" if len(out) == len(self.script) else "length") if last else None
            yield RequestOutput(request_id, [ord(ch) % 128], ch, last, reason, n, i + 1)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                                               "required": ["city"]}}}]
MSGS = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def urls() -> Iterator[tuple[str, str]]:
    """(with --tool-call-parser hermes, without)"""
    with serve(build_app(ScriptEngine(max_model_len=512), served_model_name="s", tool_call_parser="hermes")) as a, \
            serve(build_app(ScriptEngine(max_model_len=512), served_model_name="s")) as b:
        yield a, b


def test_auto_with_hermes_parser_over_http(urls: tuple[str, str]) -> None:
    client = openai.OpenAI(base_url=urls[0] + "/v1", api_key="x", max_retries=0, timeout=30)
    for choice in ({"tool_choice": "auto"}, {}):  # OpenAI's default with tools is "auto"
        r = client.chat.completions.create(model="s", messages=MSGS, tools=TOOLS, max_tokens=200, **choice)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content == "Checking."
        assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == [("get_weather", ARGS)]
        assert c.message.tool_calls[0].id.startswith("call_") and c.message.tool_calls[0].type == "function"
    content, args, reasons, names = "", "", [], []
    for chunk in client.chat.completions.create(model="s", messages=MSGS, tools=TOOLS, max_tokens=200, stream=True):
        d = chunk.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            args += t.function.arguments or ""
            names += [t.function.name] if t.function.name else []
        reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    assert (content, names, args, reasons) == ("Checking.", ["get_weather"], ARGS, ["tool_calls"])
    # no tools: the same text is plain content, untouched
    r = client.chat.completions.create(model="s", messages=MSGS, max_tokens=200)
    assert r.choices[0].message.content == ScriptEngine.script and r.choices[0].finish_reason == "stop"


def test_auto_without_a_parser_is_a_400_saying_so(urls: tuple[str, str]) -> None:
    client = openai.OpenAI(base_url=urls[1] + "/v1", api_key="x", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="s", messages=MSGS, tools=TOOLS, tool_choice="auto", max_tokens=5)
    assert e.value.body["param"] == "tool_choice" and "--tool-call-parser" in e.value.body["message"]  # type: ignore[index]
    r = client.chat.completions.create(model="s", messages=MSGS, tools=TOOLS, max_tokens=200)  # no tool_choice
    assert r.choices[0].message.content == ScriptEngine.script and not r.choices[0].message.tool_calls


def _tool(name: str = "f", params: Any = None) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name}
    if params is not None:
        fn["parameters"] = params
    return {"type": "function", "function": fn}


BAD: list[tuple[str, dict[str, Any]]] = [
    ("tools.0.function.name", {"tools": [_tool("has space")]}),
    ("tools.0.function.name", {"tools": [_tool("x" * 65)]}),
    ("tools.0.function.name", {"tools": [{"type": "function", "function": {}}]}),
    ("tools.0.function.parameters", {"tools": [_tool("f", {"type": "string"})]}),
    ("tools.0.function.parameters", {"tools": [_tool("f", [1])]}),
    ("tools.0.type", {"tools": [{"type": "code", "function": {"name": "f"}}]}),
    ("tools", {"tools": [_tool("f"), _tool("f")]}),
    ("tools", {"tools": "f"}),
    ("tool_choice", {"tools": [_tool()], "tool_choice": "sometimes"}),
    ("tool_choice", {"tools": [_tool()], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
    ("tool_choice", {"tool_choice": "required"}),
    ("tool_choice", {"tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("tool_choice", {"tools": [_tool()], "tool_choice": "required", "response_format": {"type": "json_object"}}),
    ("tool_choice", {"tools": [_tool()], "tool_choice": {"type": "function"}}),
    ("tool_choice", {"tools": [_tool()], "tool_choice": 3}),
    ("messages.1.tool_calls", {"messages": [*MSGS, {"role": "assistant", "tool_calls": [{"id": "1"}]}]}),
    ("messages.1.tool_calls", {"messages": [*MSGS, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{nope"}}]}]}),
]


@pytest.mark.parametrize("param,body", [b for b in BAD], ids=[f"{i}:{b[0]}" for i, b in enumerate(BAD)])
def test_bad_tool_definitions_are_400s_naming_the_field(urls: tuple[str, str], param: str,
                                                        body: dict[str, Any]) -> None:
    r = httpx.post(urls[0] + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_tool_conversation_reaches_the_template(urls: tuple[str, str]) -> None:
    """An assistant's tool_calls (arguments as JSON text, OpenAI's shape) and the tool's answer are accepted."""
    msgs = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    r = httpx.post(urls[1] + "/v1/chat/completions", json={"messages": msgs, "tools": TOOLS, "max_tokens": 3},
                   timeout=30)
    assert r.status_code == 200, r.text
