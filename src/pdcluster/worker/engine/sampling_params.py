"""Per-request generation settings (the engine's side of the OpenAI request body)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # vLLM's default max_logprobs; OpenAI's chat allows top_logprobs up to 20
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice")  # what engine/structured.py compiles
MAX_STRUCTURED_SPEC = 64 * 1024  # characters of a schema / regex / choice list


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 = disabled
    seed: int | None = None  # reproducible per request when set
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the output)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS / stop ids masked and stop strings ignored until this many tokens are out
    presence_penalty: float = 0.0  # [-2, 2], on tokens already generated (OpenAI)
    frequency_penalty: float = 0.0  # [-2, 2], times how often a token was generated (OpenAI)
    repetition_penalty: float = 1.0  # > 0, on tokens of prompt and output (HF / vLLM: divide positive logits)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, [-100, 100]
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob and the k most likely
    # Structured output (engine/structured.py): "json_object" | "json_schema" | "regex" | "choice", and the
    # schema (JSON text) / regex / JSON list of choices. The tokens are masked to what the grammar allows.
    structured_kind: str | None = None
    structured_spec: str = ""
    # Output index of the first token this request generates: > 0 when a worker continues a stream others
    # started (the router's resume sends prompt + the tokens already delivered). Seeded sampling draws by
    # output index, so the continuation draws what one worker alone would have drawn. Not an API field.
    first_output_index: int = 0

    def validate(self) -> None:
        """Raise ValueError with a user-facing message; the server maps it to HTTP 400. Types are checked
        too: params can arrive from an internal route as plain JSON, and a wrong type must fail here, not
        inside an engine step."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError("max_tokens must be an integer >= 1")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError("temperature must be a finite number >= 0")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError("top_p must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError("top_k must be an integer >= 0 (0 disables it)")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise ValueError("seed must be an integer in [-2**63, 2**64)")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be a list of strings")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of integers")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError("ignore_eos must be a boolean")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be an integer in [0, max_tokens]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2]")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError("repetition_penalty must be in (0, 10]")
        if not isinstance(self.logit_bias, dict) or not all(
                _is_int(k) and k >= 0 and _is_number(v) and -100.0 <= v <= 100.0 for k, v in self.logit_bias.items()):
            raise ValueError("logit_bias must map token ids (integers >= 0) to numbers in [-100, 100]")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}]")
        if self.structured_kind is not None and self.structured_kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured_kind must be one of {', '.join(STRUCTURED_KINDS)}")
        if not isinstance(self.structured_spec, str) or len(self.structured_spec) > MAX_STRUCTURED_SPEC:
            raise ValueError(f"structured_spec must be a string of at most {MAX_STRUCTURED_SPEC} characters")
        if not _is_int(self.first_output_index) or self.first_output_index < 0:
            raise ValueError("first_output_index must be an integer >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def shapes_logits(self) -> bool:
        """Whether anything but temperature/top-k/top-p changes the logits (then the sampler needs history)."""
        return bool(self.min_tokens or self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.structured_kind)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
