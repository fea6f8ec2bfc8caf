"""Tool calls with the official `openai` client on a tiny random model, on both paths (a worker alone, and
router -> prefill -> KV transfer -> decode), both started with --tool-call-parser hermes: a named or "required"
tool_choice constrains the output to a call (grammar), `auto` parses Hermes blocks; same seed, same calls."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from ..disagg.harness import Cluster, cluster, metric

PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "metric": {"type": "boolean"}},
          "required": ["city", "metric"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
MSGS = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def paths(tiny_model_dir: Path) -> Iterator[tuple[Any, Any, Cluster]]:
    with cluster(tiny_model_dir, threshold=0, tool_call_parser="hermes") as c:
        alone = openai.OpenAI(base_url=c.decode[0] + "/v1", api_key="x", max_retries=0, timeout=60)
        routed = openai.OpenAI(base_url=c.router + "/v1", api_key="x", max_retries=0, timeout=60)
        yield alone, routed, c


def _fits(name: str, arguments: str) -> bool:
    args = json.loads(arguments)
    if name == "get_weather":
        return set(args) == {"city", "metric"} and args["city"] in ("Paris", "Rome", "Oslo") and \
            isinstance(args["metric"], bool)
    return name == "get_time" and args in ({"zone": "UTC"}, {"zone": "CET"})


def _calls(resp: Any) -> list[tuple[str, str]]:
    msg = resp.choices[0].message
    assert all(t.id.startswith("call_") and t.type == "function" for t in msg.tool_calls)
    return [(t.function.name, t.function.arguments) for t in msg.tool_calls]


def _stream(client: Any, body: dict[str, Any]) -> tuple[str, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) accumulated from a stream, as a client does."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(model="tiny", stream=True, **body):
        c = chunk.choices[0]
        content += c.delta.content or ""
        for t in c.delta.tool_calls or []:
            name, args = calls.get(t.index, ("", ""))
            calls[t.index] = (t.function.name or name, args + (t.function.arguments or ""))
        reason = c.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_calls_same_on_both_paths(paths: tuple[Any, Any, Cluster], choice: Any) -> None:
    alone, routed, c = paths
    body = {"messages": MSGS, "tools": TOOLS, "tool_choice": choice, "max_tokens": 120, "seed": 3,
            "temperature": 0.9}
    sent = metric(c.prefill[0], "pdcluster_kv_transfer_bytes_total")
    a, b = alone.chat.completions.create(model="tiny", **body), routed.chat.completions.create(model="tiny", **body)
    assert metric(c.prefill[0], "pdcluster_kv_transfer_bytes_total") > sent  # the router path disaggregated
    assert _calls(a) == _calls(b) and len(_calls(a)) == 1
    name, arguments = _calls(a)[0]
    assert _fits(name, arguments) and (choice == "required" or name == "get_time")
    for r in (a, b):
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    for client in (alone, routed):  # streamed: the same call, a delta at a time
        assert _stream(client, body) == ("", _calls(a), "tool_calls")


def test_auto_hermes_same_on_both_paths(paths: tuple[Any, Any, Cluster]) -> None:
    """A random model does not write Hermes blocks on its own: a regex makes it, and the parser reads them."""
    alone, routed, _ = paths
    regex = r'On it\.<tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
    body = {"messages": MSGS, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 120, "seed": 5,
            "extra_body": {"guided_regex": regex}}
    a, b = alone.chat.completions.create(model="tiny", **body), routed.chat.completions.create(model="tiny", **body)
    assert _calls(a) == _calls(b) and _fits(*_calls(a)[0])
    assert a.choices[0].message.content == b.choices[0].message.content == "On it."
    assert a.choices[0].finish_reason == b.choices[0].finish_reason == "tool_calls"
    for client in (alone, routed):
        assert _stream(client, body) == ("On it.", _calls(a), "tool_calls")


def test_bad_tools_are_400s_on_both_paths(paths: tuple[Any, Any, Cluster]) -> None:
    alone, routed, _ = paths
    bad: list[tuple[str, dict[str, Any]]] = [
        ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}], "tool_choice": "required"}),
        ("tool_choice", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
        ("tools.0.function.parameters", {"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "array"}}}]}),
    ]
    for client in (alone, routed):
        for param, extra in bad:
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, **extra)
            assert e.value.body["param"] == param, e.value.body  # type: ignore[index]
            assert ".cc:" not in e.value.body["message"]  # type: ignore[index]
