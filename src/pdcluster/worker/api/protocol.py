"""OpenAI-compatible request and response bodies for /v1/completions and /v1/chat/completions.

Validation is strict (no "5" -> 5 coercion, no NaN) because every malformed input must be a
400 with a clear message, not a surprising generation. Fields no OpenAI or vLLM client uses to
change the output are ignored, so stock clients (which send e.g. `user`, `store`, `metadata`)
keep working. Every field that would change the output and is not implemented (those in `UNIMPLEMENTED`:
tools, response_format, ...) is rejected with a 400 naming it when it holds anything but its no-op value,
never silently ignored.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pdcluster.worker.api.structured_request import (
    NamedToolChoice,
    ResponseFormat,
    Tool,
    check_tool_call_messages,
    check_tools,
    field_error,
    forced_call,
    structured_of,
    tool_plan_of,
)
from pdcluster.worker.api.tool_calls import ToolPlan
from pdcluster.worker.engine.sampling_params import MAX_LOGPROBS, SamplingParams

_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 1024  # as logit_bias: a million ids was a 5 s loop stall in the vocabulary check
MAX_MESSAGES = 4096
MAX_GUIDED_CHOICES = 1024
MAX_CHOICES = 128  # prompts x n of one request (OpenAI's bound on n)

# Fields of the OpenAI / vLLM request bodies that would change the output and are not implemented yet, each
# with the values that change nothing (accepted, since some clients send them by default).
UNIMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "prompt_logprobs": (None, 0),
    "length_penalty": (None, 1, 1.0),
    "min_p": (None, 0, 0.0),
    "use_beam_search": (None, False),
    "include_stop_str_in_output": (None, False),
    "truncate_prompt_tokens": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "continue_final_message": (None, False),
    "guided_grammar": (None,),
    "guided_whitespace_pattern": (None,),
    "structured_outputs": (None,),
    "prediction": (None,),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "reasoning_effort": (None,),
}


def _same(a: Any, b: Any) -> bool:
    # type-exact: `true` is not the no-op `1`, `0.0` is the no-op `0`
    return a == b and (type(a) is type(b) or {type(a), type(b)} <= {int, float})


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False  # a last chunk with `choices: []` and the usage (OpenAI, vLLM)


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints; `to_sampling_params` maps them onto the engine's type."""

    model_config = _STRICT
    # UNIMPLEMENTED fields this endpoint does implement (chat: tools into the template, chat_template_kwargs)
    implemented: ClassVar[frozenset[str]] = frozenset()

    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # -1 is vLLM's spelling of "disabled"; 0 is ours.
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # what torch's generator takes
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    n: int | None = 1
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    min_tokens: int | None = Field(default=None, ge=0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # structured output: OpenAI's response_format, vLLM's guided_* extras (at most one of them)
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, max_length=MAX_GUIDED_CHOICES)
    # pdcluster extensions
    return_token_ids: bool = False
    ignore_eos: bool = False

    @model_validator(mode="before")
    @classmethod
    def _unimplemented(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, no_ops in UNIMPLEMENTED.items():
                if name in data and name not in cls.implemented and not any(_same(data[name], v) for v in no_ops):
                    # PydanticCustomError keeps the field in `loc`, so the 400 names it (OpenAI's `param`).
                    raise ValidationError.from_exception_data(cls.__name__, [{
                        "type": PydanticCustomError(
                        "unimplemented", f"not supported yet; leave {name} out (or at its default)"),
                        "loc": (name,), "input": None}])
        return data

    @field_validator("n")
    @classmethod
    def _choices(cls, v: int | None) -> int | None:
        if v is not None and not 1 <= v <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}]")
        return v

    def num_choices(self) -> int:
        return self.n or 1

    @model_validator(mode="after")
    def _one_structure(self) -> Any:
        self.structured()  # raises for two structures at once, or one that is not well formed
        return self

    def structured(self) -> tuple[str, str, str] | None:
        """(the field that asked for it, structured_kind, structured_spec), or None (api/structured_request.py)."""
        return structured_of(self.response_format, self.guided_json, self.guided_regex, self.guided_choice)

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for k, b in (v or {}).items():
            if not (k.isascii() and k.isdigit() and len(k) <= 12):
                raise ValueError(f"logit_bias keys must be token ids (got {k[:20]!r})")
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100] (got {b} for {k})")
        if v and len(v) > 1024:
            raise ValueError("logit_bias may hold at most 1024 tokens")
        return v

    def num_logprobs(self) -> int | None:
        """How many top logprobs per token (None: no logprobs at all); each endpoint spells it differently."""
        return None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=0 if self.top_k is None or self.top_k < 0 else self.top_k,
            seed=self.seed,
            stop=self.stop_list(),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens or 0,
            presence_penalty=float(self.presence_penalty or 0.0),
            frequency_penalty=float(self.frequency_penalty or 0.0),
            repetition_penalty=1.0 if self.repetition_penalty is None else float(self.repetition_penalty),
            logit_bias={int(k): float(v) for k, v in (self.logit_bias or {}).items()},
            logprobs=self.num_logprobs(),
        )
        structured = self.structured()
        if structured is not None:
            params.structured_kind, params.structured_spec = structured[1], structured[2]
        return params  # api.limits.checked_params validates it (with the engine's own check) once


class CompletionRequest(_SamplingFields):
    # Declared loosely and checked in `_prompt_shape` so a bad prompt gets one clear message
    # instead of pydantic's four-way union error.
    prompt: Any
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def num_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, v: Any) -> str | list[int] | list[str | list[int]]:
        """One prompt (a string or token ids) or a batch of them (a list of strings / of token-id lists)."""
        if isinstance(v, list) and v and all(isinstance(t, str | list) for t in v):
            if len(v) > MAX_CHOICES:
                raise ValueError(f"at most {MAX_CHOICES} prompts in one request")
            return [_one_prompt(t) for t in v]
        return _one_prompt(v)

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs (prompt logprobs) is not supported; drop one of them")
        if self.best_of not in (None, 1) and self.best_of != self.n:
            raise ValueError("best_of is not supported (only 1, or equal to n)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if len(self.prompts()) * self.num_choices() > MAX_CHOICES:
            raise ValueError(f"prompts x n must be at most {MAX_CHOICES}")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        return list(p) if isinstance(p, list) and p and isinstance(p[0], str | list) else [p]

    def prompt_chars(self) -> int:
        return sum(len(p) for p in self.prompts() if isinstance(p, str))


def _one_prompt(v: Any) -> str | list[int]:
    if isinstance(v, str):
        if v == "":
            raise ValueError("prompt must not be empty")
        return v
    if isinstance(v, list):
        if not v:
            raise ValueError("prompt must not be empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            raise ValueError("prompt must be a string, a list of integer token ids, or a list of those")
        return list(v)
    raise ValueError("prompt must be a string, a list of integer token ids, or a list of those")


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls, for the template
    tool_call_id: str | None = None  # a tool message's answer to one

    @field_validator("tool_calls")
    @classmethod
    def _calls(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return check_tool_call_messages(v)

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' keys; optional ones only when set)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def template_chars(self) -> int:
        """Characters this message puts into the template's input: its text, name and earlier calls."""
        calls = len(json.dumps(self.tool_calls)) if self.tool_calls else 0
        return len(self.text()) + len(self.name or "") + len(self.tool_call_id or "") + calls


def template_input_chars(messages: list[ChatMessage], tools: list[Any] | None = None,
                         kwargs: dict[str, Any] | None = None) -> int:
    """Everything a chat template renders from, in characters: counted against the prompt cap *before* the
    template runs (20 MB of tool descriptions were a 30-80 s render, then a prompt far over any context)."""
    n = sum(m.template_chars() for m in messages)
    if tools:
        n += sum(len(t.model_dump_json()) for t in tools)
    if kwargs:
        n += len(json.dumps(kwargs))
    return n


# Template variables a request's chat_template_kwargs may not replace (the server sets them).
RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


class ChatCompletionRequest(_SamplingFields):
    # tools reach the chat template (the model sees them); tool_choice named / "required" constrains the output
    # to a call (a grammar), "auto" parses calls out of free text (needs --tool-call-parser; api/tool_calls.py)
    implemented: ClassVar[frozenset[str]] = frozenset({"tools", "tool_choice", "chat_template_kwargs"})
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: str | NamedToolChoice | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice_shape(cls, v: Any) -> Any:
        # one message for either shape, instead of pydantic's error per member of the union
        if isinstance(v, dict):
            try:
                return NamedToolChoice.model_validate(v)
            except ValidationError:
                pass
        elif v is None or isinstance(v, str):
            return v
        raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
    chat_template_kwargs: dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    add_generation_prompt: bool = True
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # vLLM's chat extension (echo the last message): not implemented

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.echo:
            raise ValueError("echo is not supported on chat completions")
        clash = sorted(RESERVED_TEMPLATE_VARS & set(self.chat_template_kwargs or {}))
        if clash:
            raise field_error("chat_template_kwargs", f"may not set {', '.join(clash)} (the server sets it)")
        check_tools(self.tools, self.tool_choice)
        return self

    def structured(self) -> tuple[str, str, str] | None:
        """response_format / guided_*, or the call a named / "required" tool_choice forces (one of them)."""
        asked = super().structured()
        forced = self._forced_call()
        if forced is not None and asked is not None:
            raise field_error("tool_choice", f"{asked[0]} and tool_choice both constrain the output; send one")
        return forced or asked

    def _forced_call(self) -> tuple[str, str, str] | None:
        return forced_call(self.tools, self.tool_choice)

    def tool_plan(self, parser: str | None) -> ToolPlan | None:
        """How the output becomes tool calls, given the server's --tool-call-parser (a 400 for "auto" without)."""
        return tool_plan_of(self.tools, self.tool_choice, parser)

    def template_extras(self) -> dict[str, Any]:
        """render_chat's tools / template_kwargs for this request."""
        tools = None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]
        return {"tools": tools, "template_kwargs": dict(self.chat_template_kwargs or {})}

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def prompt_chars(self) -> int:
        return template_input_chars(self.messages, self.tools, self.chat_template_kwargs)

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]
