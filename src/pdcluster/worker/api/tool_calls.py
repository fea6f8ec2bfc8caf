"""Tool calls in chat output, as vLLM serves them: what a request's `tool_choice` asks for (a `ToolPlan`), the
grammar that forces a call (named function, or `"required"`), and the parser that turns generated text into
OpenAI `tool_calls`, incrementally (stream deltas) and whole (the non-streamed message, built from the same
deltas so both always agree).

- **named** (`{"type": "function", "function": {"name": N}}`): the output is N's arguments, constrained to
  its `parameters` schema; the whole text is the call's `arguments`.
- **required**: the output is `{"name": <one of the tools>, "arguments": {...}}` (a grammar: an `anyOf` over
  the tools); the name is read as soon as it is complete, the arguments text streamed after it.
- **auto** (needs `--tool-call-parser hermes`): the model writes Hermes / Qwen `<tool_call>{json}</tool_call>`
  blocks wherever it wants; each becomes a call, the text outside stays `content`.

Pure: no I/O, no engine. The router and the worker shape with it alike.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pdcluster.worker.api.json_shape import loads_bounded

ToolMode = Literal["named", "required", "auto"]
PARSERS = ("hermes",)  # --tool-call-parser choices
_START, _END = "<tool_call>", "</tool_call>"
# `{"name": "<name>", "arguments": ` as the required-mode grammar writes it (compact JSON, schema order),
# matched once the arguments' first character is there (text arrives a token at a time)
_REQUIRED_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')
EMPTY_OBJECT_SCHEMA: dict[str, Any] = {"type": "object", "properties": {}}
# Generated JSON read back as a call nests at most this deep; deeper is text (json.loads would recurse until
# RecursionError on a model that writes 1,400 `[`, and the whole response would be a 500).
MAX_OUTPUT_DEPTH = 64


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request's output becomes tool calls (None when it does not)."""

    mode: ToolMode
    name: str | None = None  # the function of a named tool_choice
    parser: str | None = None  # auto: the --tool-call-parser

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "name": self.name, "parser": self.parser}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> ToolPlan | None:
        if not d:
            return None
        mode = d.get("mode")
        if mode not in ("named", "required", "auto"):
            raise ValueError(f"unknown tool plan mode {mode!r}")
        return cls(mode, d.get("name"), d.get("parser"))


def arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function's arguments schema: its `parameters`, or an empty object when it declares none (vLLM)."""
    return parameters if parameters else EMPTY_OBJECT_SCHEMA


def forced_call_schema(plan: ToolPlan, functions: list[tuple[str, dict[str, Any] | None]]) -> dict[str, Any]:
    """The JSON schema a named / required tool_choice constrains the output to; `functions` = (name,
    parameters) of each tool."""
    if plan.mode == "named":
        return arguments_schema(dict(functions)[plan.name or ""])
    cases = [{"type": "object", "properties": {"name": {"const": name}, "arguments": arguments_schema(params)},
              "required": ["name", "arguments"]} for name, params in functions]
    return cases[0] if len(cases) == 1 else {"anyOf": cases}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_delta(index: int, name: str | None, arguments: str, head: bool) -> dict[str, Any]:
    """One `delta.tool_calls[]` item: the first of a call carries id, type and name; later ones only text."""
    if not head:
        return {"index": index, "function": {"arguments": arguments}}
    return {"index": index, "id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


# A delta: ("content", text) or ("call", a tool_calls item)
Delta = tuple[Literal["content", "call"], Any]


@dataclass
class ToolCallStream:
    """One choice's text -> deltas. `feed` each new piece of text, `finish` once at the end."""

    plan: ToolPlan
    calls: int = 0  # calls started so far
    _buf: str = ""
    _in_call: bool = False  # auto: inside a <tool_call> block
    _emitted: str = ""  # named / required: all text seen (to decide at the end)
    _ws: str = ""  # content whitespace held back until non-blank text follows (dropped after a call)
    _name: str | None = field(default=None)

    @property
    def made_calls(self) -> bool:
        return self.calls > 0

    def feed(self, text: str) -> list[Delta]:
        if not text:
            return []
        if self.plan.mode == "named":
            return self._named(text)
        if self.plan.mode == "required":
            return self._required(text)
        self._buf += text
        return self._hermes()

    def finish(self) -> list[Delta]:
        if self.plan.mode == "named":
            return [] if self.calls else self._named("", force=True)
        if self.plan.mode == "required":
            return self._required_end()
        out: list[Delta] = []
        if self._in_call:  # an unclosed block at the end: a call if its JSON is whole, else text
            out += self._close_block(self._buf, closed=False)
        else:
            out += self._content(self._buf)
        self._buf, self._in_call = "", False
        if self._ws and not self.calls:
            out.append(("content", self._ws))
        self._ws = ""
        return out

    # ------------------------------------------------------------------ named: the text is the arguments
    def _named(self, text: str, force: bool = False) -> list[Delta]:
        if not text and not force:
            return []
        head = self.calls == 0
        self.calls = 1
        return [("call", _call_delta(0, self.plan.name, text, head))]

    # ------------------------------------------------------------------ required: {"name": N, "arguments": A}
    def _required(self, text: str) -> list[Delta]:
        self._emitted += text
        if self._name is None:
            m = _REQUIRED_HEAD.match(self._emitted)
            if m is None:
                return []
            self._name = str(json.loads(m.group(1)))
            self._buf = self._emitted[m.end():]
            self.calls = 1
            out: list[Delta] = [("call", _call_delta(0, self._name, "", True))]
        else:
            self._buf += text
            out = []
        # hold back the last character: it may be the outer object's closing brace
        if len(self._buf) > 1:
            out.append(("call", _call_delta(0, None, self._buf[:-1], False)))
            self._buf = self._buf[-1:]
        return out

    def _required_end(self) -> list[Delta]:
        if self._name is None:  # cut before the name was complete: nothing to call, say what was written
            return [("content", self._emitted)] if self._emitted else []
        try:
            whole = isinstance(loads_bounded(self._emitted, MAX_OUTPUT_DEPTH), dict)
        except ValueError:  # not JSON, or deeper than any call's arguments can be
            whole = False
        rest = self._buf.rstrip()
        if whole and rest.endswith("}"):
            rest = rest[:-1]  # the outer object's brace; the arguments end before it
        else:
            rest = self._buf  # cut short (max_tokens): the arguments as far as they got
        return [("call", _call_delta(0, None, rest, False))] if rest else []

    # ------------------------------------------------------------------ auto: hermes <tool_call> blocks
    def _hermes(self) -> list[Delta]:
        out: list[Delta] = []
        while True:
            if self._in_call:
                j = self._buf.find(_END)
                if j < 0:
                    return out
                body, self._buf = self._buf[:j], self._buf[j + len(_END):]
                self._in_call = False
                out += self._close_block(body, closed=True)
                continue
            i = self._buf.find(_START)
            if i >= 0:
                out += self._content(self._buf[:i])
                self._buf, self._in_call = self._buf[i + len(_START):], True
                continue
            keep = _partial_tag(self._buf)  # a tag may be arriving token by token
            out += self._content(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return out

    def _close_block(self, body: str, closed: bool) -> list[Delta]:
        call = _hermes_call(body)
        if call is None:  # not a call after all: it is text
            return self._content(_START + body + (_END if closed else ""))
        name, arguments = call
        index = self.calls
        self.calls += 1
        return [("call", _call_delta(index, name, arguments, True))]

    def _content(self, text: str) -> list[Delta]:
        """Text outside calls; whitespace waits for what follows it (trailing blanks after a call are dropped,
        so the content of `text<tool_call>..</tool_call>\\n` is `text`, streamed or not)."""
        if not text:
            return []
        core = text.rstrip()
        if not core:
            self._ws += text
            return []
        out = self._ws + core
        self._ws = text[len(core):]
        return [("content", out)]


def _partial_tag(buf: str) -> int:
    """How many trailing characters of `buf` could be the start of `<tool_call>`."""
    for k in range(min(len(buf), len(_START) - 1), 0, -1):
        if _START.startswith(buf[-k:]):
            return k
    return 0


def _hermes_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a `<tool_call>` block's JSON, or None when it is not a call."""
    try:
        obj = loads_bounded(body, MAX_OUTPUT_DEPTH)
    except ValueError:  # not JSON, or deeper than a call can be: the block is text
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def merge_deltas(deltas: list[Delta]) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(content, tool_calls) of a whole message from its deltas: what a client accumulating the stream gets."""
    content = "".join(d for kind, d in deltas if kind == "content")
    calls: dict[int, dict[str, Any]] = {}
    for kind, d in deltas:
        if kind != "call":
            continue
        if d["index"] not in calls:
            calls[d["index"]] = {"id": d["id"], "type": "function",
                                 "function": {"name": d["function"]["name"], "arguments": ""}}
        calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return content or None, [calls[i] for i in sorted(calls)] or None


def parse_whole(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """A non-streamed choice's (content, tool_calls): the stream parser over the whole text."""
    s = ToolCallStream(plan)
    return merge_deltas(s.feed(text) + s.finish())


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """OpenAI says `tool_calls` when the model stopped after calling; a cut (`length`) stays what it is."""
    return "tool_calls" if made_calls and reason == "stop" else reason
