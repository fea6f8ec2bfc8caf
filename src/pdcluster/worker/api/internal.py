"""The bodies of the router -> worker `/internal/*` calls, validated like public bodies: strict types, no
unknown fields, finite numbers, and the same sampling rules, so a malformed internal call is a 400 naming the
field and never data that reaches (and fails) an engine step. The router never imports torch, and neither
does this module."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdcluster.worker.api.protocol import MAX_STOP_STRINGS
from pdcluster.worker.engine.sampling_params import MAX_LOGPROBS, MAX_STRUCTURED_SPEC, SamplingParams

_INTERNAL = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class Params(BaseModel):
    """`SamplingParams` on the wire (what `/internal/tokenize` returns); every field of the dataclass."""

    model_config = _INTERNAL
    max_tokens: int = Field(ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    logit_bias: dict[int, float] = Field(default_factory=dict)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    first_output_index: int = Field(default=0, ge=0)
    structured_kind: Literal["json_object", "json_schema", "regex", "choice"] | None = None
    structured_spec: str = Field(default="", max_length=MAX_STRUCTURED_SPEC)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_keys(cls, v: Any) -> Any:
        # JSON object keys are strings: "123" is token 123 (what json.dumps made of the int key)
        if isinstance(v, dict):
            return {int(k) if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 12 else k: b
                    for k, b in v.items()}
        return v

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    def to_sampling_params(self) -> SamplingParams:
        names = {f.name for f in dataclasses.fields(SamplingParams)}
        return SamplingParams(**{k: v for k, v in self.model_dump().items() if k in names})


class _Run(BaseModel):
    model_config = _INTERNAL
    request_id: str = Field(min_length=1, max_length=256)  # it ends up in logs and frame headers
    prompt_token_ids: list[int] = Field(min_length=1)
    params: Params


class ReserveBody(_Run):
    # the prefill worker's TP when its ranks will send their own KV heads (server/tp_direct.py); absent:
    # whole layers to this worker's rank 0, as always
    prefill_tp: int | None = Field(default=None, ge=1, le=1024)


class GenerateBody(_Run):
    pass


class Target(BaseModel):
    model_config = _INTERNAL
    host: str = Field(min_length=1, max_length=255)
    port: int = Field(ge=1, le=65535)
    # every decode rank's transfer port (rank 0 first, on `host`) when it takes each rank's heads itself
    rank_ports: list[Annotated[int, Field(ge=1, le=65535)]] | None = Field(default=None, min_length=1,
                                                                         max_length=1024)


class PrefillBody(_Run):
    target: Target


class DecodeBody(BaseModel):
    model_config = _INTERNAL
    request_id: str = Field(min_length=1, max_length=256)  # it ends up in logs and frame headers
    first_token_id: int = Field(ge=0)


class CancelBody(BaseModel):
    model_config = _INTERNAL
    request_id: str = Field(min_length=1, max_length=256)  # it ends up in logs and frame headers


class TokenizeBody(BaseModel):
    model_config = _INTERNAL
    kind: Literal["completions", "chat"]
    body: dict[str, Any]
    tool_call_parser: Literal["hermes"] | None = None  # the router's --tool-call-parser (tool_choice "auto")
