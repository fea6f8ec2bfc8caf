"""The bodies of vLLM's /tokenize and /detokenize (protocol.py holds the generation bodies)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdcluster.worker.api.protocol import MAX_MESSAGES, ChatMessage, template_input_chars


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the model's template."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[ChatMessage] | None = Field(default=None, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        return self

    def prompt_chars(self) -> int:
        return len(self.prompt or "") if self.messages is None else template_input_chars(self.messages)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)
