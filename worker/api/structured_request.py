"""The structured-output and tool parts of a chat / completion request body: OpenAI's response_format and tool
definitions, vLLM's guided_* extras, and the one grammar they ask for (kind and spec, as SamplingParams carries
them; engine/structured.py compiles it)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

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
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef



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
        try:
            schema = json.loads(found[0][2])
        except json.JSONDecodeError as e:
            raise field_error(found[0][0], f"not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise field_error(found[0][0], "must be a JSON schema (an object)")
    return found[0] if found else None
