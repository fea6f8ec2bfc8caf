"""A request as a worker's /internal/tokenize answered it (`Tokenized`, one per choice when it fans out), and a
piece of a worker's streamed reply (`Chunk`): what Flow routes and the router's front shapes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdcluster.worker.api import tracing


@dataclass
class Tokenized:
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams as a dict (the router never imports torch)
    model: str
    stream: bool = False
    return_token_ids: bool = False
    index: int = 0  # the choice this request produces (prompt i, sample j of n -> i * n + j)
    echo: str = ""  # text before the choice's text (completions with echo)
    n: int = 1
    include_usage: bool = False
    tools: dict[str, Any] | None = None  # how the chat output becomes tool calls (api/tool_calls.ToolPlan)
    subs: list[Tokenized] = field(default_factory=list)  # every choice's request (itself when there is one)
    trace: tracing.Span = tracing.NO_SPAN  # the request's span (api/tracing.py): parent of its phases and calls

    def choices(self) -> list[Tokenized]:
        return self.subs or [self]


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[dict[str, Any]] | None = None  # one entry per token when asked for (see RequestOutput)


def tokenized_answer(d: dict[str, Any]) -> Tokenized:
    """A worker's /internal/tokenize answer; `subs` (one per choice) when the request fans out."""
    tok = Tokenized(d["prompt_token_ids"], d["params"], d["model"], bool(d.get("stream", False)),
                    bool(d.get("return_token_ids", False)), n=int(d.get("n", 1)),
                    include_usage=bool(d.get("include_usage", False)), tools=d.get("tools"))
    tok.subs = [Tokenized(s["prompt_token_ids"], s["params"], tok.model, tok.stream, tok.return_token_ids,
                          index=int(s["index"]), echo=str(s.get("echo") or ""), n=tok.n)
                for s in d.get("subs") or []]
    return tok
