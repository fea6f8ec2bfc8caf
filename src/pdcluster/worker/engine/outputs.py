"""What the engine hands back per request and step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]  # tokens produced since the previous output for this request
    new_text: str = ""  # incremental detokenization; never splits a UTF-8 character
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total generated so far
    error: str | None = None  # set when finish_reason == "error"
    # One entry per new token when the request asked for logprobs: {"token_id", "token", "logprob", "bytes",
    # "top": [{"token_id", "token", "logprob", "bytes"}, ...]} (plain data: it travels as JSON between workers)
    logprobs: list[dict] | None = None
    extra: dict = field(default_factory=dict)
