"""The structured-output and tool parts of a chat / completion request body: OpenAI's response_format and tool
definitions, vLLM's guided_* extras, and the one grammar they ask for (kind and spec, as SamplingParams carries
them; engine/structured.py compiles it)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pdcluster.worker.api import errors
from pdcluster.worker.api.json_shape import MAX_DEPTH, loads_bounded
from pdcluster.worker.api.tool_calls import ToolPlan, forced_call_schema
from pdcluster.worker.engine.sampling_params import MAX_STRUCTURED_SPEC

_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def field_error(name: str, message: str) -> ValidationError:
    """A validation error located at ``name`` (the 400's `param`) with our message as is."""
    return ValidationError.from_exception_data("request", [{
        "type": PydanticCustomError("invalid_field", message), "loc": (name,), "input": None}])


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")  # `schema` would shadow BaseModel.schema
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


class FunctionDef(BaseModel):
    model_config = _STRICT
    # OpenAI's rule for function names (they are also what a parser reads back out of the text)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        # a call's arguments are a JSON object (OpenAI's rule): a schema of anything else cannot be one
        if v is not None and v.get("type", "object") != "object":
            raise ValueError(f"must be a JSON schema of type object (got type {str(v.get('type'))[:20]!r})")
        return v


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    """tool_choice {"type": "function", "function": {"name": ...}}: call exactly this function."""

    model_config = _STRICT
    type: Literal["function"]
    function: NamedFunction


def check_tools(tools: list[Tool] | None, tool_choice: str | NamedToolChoice | None) -> None:
    """Tool names are unique, and tool_choice names a mode we know or one of the tools."""
    names = [t.function.name for t in tools or []]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise field_error("tools", f"two tools are named {dup!r}; names must be unique")
    if isinstance(tool_choice, str) and tool_choice not in ("none", "auto", "required"):
        raise field_error("tool_choice", 'must be "none", "auto", "required" or {"type": "function", '
                                         f'"function": {{"name": ...}}}} (got {tool_choice[:40]!r})')
    if tool_choice not in (None, "none") and not names:
        raise field_error("tool_choice", "needs tools: there is no function to call")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise field_error("tool_choice", f"names function {tool_choice.function.name[:64]!r}, which is not in tools")


def forced_call(tools: list[Tool] | None, choice: str | NamedToolChoice | None) -> tuple[str, str, str] | None:
    """(field, structured_kind, spec) of the call a named / "required" tool_choice forces, or None."""
    if not (choice == "required" or isinstance(choice, NamedToolChoice)):
        return None
    check_tools(tools, choice)  # (a request's structured() runs before its own checks do)
    plan = ToolPlan("named", choice.function.name) if isinstance(choice, NamedToolChoice) else ToolPlan("required")
    spec = json.dumps(forced_call_schema(plan, [(t.function.name, t.function.parameters) for t in tools or []]))
    if len(spec) > MAX_STRUCTURED_SPEC:
        raise field_error("tools", f"the tools' schemas are longer than {MAX_STRUCTURED_SPEC} characters")
    return ("tools", "json_schema", spec)  # a schema that does not compile is the tools' fault


def tool_plan_of(tools: list[Tool] | None, choice: str | NamedToolChoice | None, parser: str | None) -> ToolPlan | None:
    """How a chat request's output becomes tool calls, given the server's --tool-call-parser; a 400 for "auto"
    without one. With tools and no tool_choice OpenAI's default is "auto": parsed when a parser is set, else the
    tools only reach the template (calls come back as text, as vLLM does without a parser)."""
    if isinstance(choice, NamedToolChoice):
        return ToolPlan("named", choice.function.name)
    if choice == "required":
        return ToolPlan("required")
    if tools and (choice == "auto" or (choice is None and parser)):
        if parser is None:
            raise errors.bad_request(
                'tool_choice "auto" needs a tool-call parser: start the server (pdcluster serve, or the router) '
                'with --tool-call-parser hermes, or send tool_choice "required" or a named function',
                param="tool_choice")
        return ToolPlan("auto", parser=parser)
    return None


def check_tool_call_messages(calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """An assistant message's earlier tool_calls, for the template: each has a function name; `arguments` (a
    JSON string in OpenAI's shape) reaches the template as an object, as vLLM passes it (templates such as
    Qwen's and Llama's write `arguments | tojson`)."""
    if calls is None:
        return None
    out = []
    for call in calls:
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError("each tool_calls item needs function.name (a string)")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:  # bounded: the string could hold JSON nested thousands deep (RecursionError otherwise)
                args = loads_bounded(args) if args.strip() else {}
            except ValueError as e:
                raise ValueError(f"tool call {fn['name'][:64]!r}: function.arguments is not valid JSON "
                                 f"({str(e)[:120]})") from None
        if not isinstance(args, dict):
            raise ValueError(f"tool call {fn['name'][:64]!r}: function.arguments must be a JSON object")
        out.append({**call, "function": {**fn, "arguments": args}})
    return out



def structured_of(response_format: ResponseFormat | None, guided_json: str | dict[str, Any] | None,
                  guided_regex: str | None, guided_choice: list[str] | None) -> tuple[str, str, str] | None:
    """(the field that asked for it, structured_kind, structured_spec) of the grammar the output must follow,
    or None. A spec that is well formed can still fail to compile: that 400 comes from the engine."""
    found: list[tuple[str, str, str]] = []
    rf = response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", "json_object", ""))
    elif rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
        found.append(("response_format", "json_schema", json.dumps(rf.json_schema.json_schema)))
    if guided_json is not None:
        spec = guided_json if isinstance(guided_json, str) else json.dumps(guided_json)
        found.append(("guided_json", "json_schema", spec))
    if guided_regex is not None:
        found.append(("guided_regex", "regex", guided_regex))
    if guided_choice is not None:
        if not guided_choice or not all(guided_choice):
            raise field_error("guided_choice", "must be a non-empty list of non-empty strings")
        found.append(("guided_choice", "choice", json.dumps(guided_choice)))
    if len(found) > 1:
        raise field_error(found[1][0], f"{found[0][0]} and {found[1][0]} both constrain the output; send one")
    if found and len(found[0][2]) > MAX_STRUCTURED_SPEC:
        raise field_error(found[0][0], f"longer than {MAX_STRUCTURED_SPEC} characters")
    if found and found[0][1] == "json_schema":
        try:  # bounded like a body: a schema string nested 3,000 deep must not reach RecursionError
            schema = loads_bounded(found[0][2], MAX_DEPTH)
        except ValueError as e:
            raise field_error(found[0][0], f"not a usable JSON schema ({str(e)[:200]})") from None
        if not isinstance(schema, dict):
            raise field_error(found[0][0], "must be a JSON schema (an object)")
    return found[0] if found else None
