"""Request limits, checked once on the way in: prompt size (characters before tokenizing, tokens after), token
ids in the vocabulary, context length, and the engine's own check. The public routes and `/internal/tokenize`
both go through `checked_params`, so a request is held to the same rules on every path; `/internal/*` routes
that receive already-tokenized work call `check_prompt` and `check_stop_ids` on what they are sent."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdcluster.worker.api import errors
from pdcluster.worker.api.grammar_jobs import JOBS, GrammarJobs
from pdcluster.worker.engine.sampling_params import SamplingParams

# A prompt is refused before tokenizing when it has more characters than it could have if every token were
# this long: real tokenizers average 3-5 characters per token and their longest tokens are a few dozen
# (whitespace runs, rulers), so such a prompt cannot fit the context, and tokenizing it would only burn CPU
# and memory (a 10 MB prompt took 17 s and 2.4 GB on a decode worker).
MAX_CHARS_PER_TOKEN = 64
MAX_PROMPT_CHARS = 4 * 1024 * 1024  # the bound when the context length is unknown


@dataclass
class ModelLimits:
    vocab_size: int | None
    max_model_len: int | None


def prompt_char_limit(limits: ModelLimits) -> int:
    if limits.max_model_len is None:
        return MAX_PROMPT_CHARS
    return min(MAX_PROMPT_CHARS, limits.max_model_len * MAX_CHARS_PER_TOKEN)


def check_prompt_chars(n_chars: int, limits: ModelLimits, param: str) -> None:
    cap = prompt_char_limit(limits)
    if n_chars > cap:
        raise errors.bad_request(
            f"{param} has {n_chars} characters, more than the {cap} that could fit the model's context "
            f"({limits.max_model_len} tokens); shorten it", param=param, code="context_length_exceeded")


def check_prompt(prompt_ids: list[int], max_tokens: int | None, limits: ModelLimits) -> int:
    """Validate token ids and length; return the max_tokens to use."""
    if not prompt_ids:
        raise errors.bad_request("prompt must not be empty", param="prompt")
    vocab = limits.vocab_size
    if vocab is not None:
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise errors.bad_request(
                f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt", code="invalid_token_id")
    limit = limits.max_model_len
    n = len(prompt_ids)
    if limit is None:
        return max_tokens if max_tokens is not None else 16
    if max_tokens is None:
        max_tokens = limit - n
        if max_tokens < 1:
            raise errors.bad_request(
                f"prompt has {n} tokens, leaving no room in the model's maximum length of {limit}",
                param="prompt", code="context_length_exceeded")
    if n + max_tokens > limit:
        raise errors.bad_request(
            f"prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds the model's maximum length of {limit}",
            param="max_tokens", code="context_length_exceeded")
    return max_tokens


def check_stop_ids(stop_token_ids: list[int], limits: ModelLimits, logit_bias: dict[int, float] | None = None) -> None:
    """Token ids the request names (stop ids, logit_bias keys) are in the vocabulary."""
    vocab = limits.vocab_size
    if vocab is not None and any(not 0 <= t < vocab for t in stop_token_ids):
        raise errors.bad_request(f"stop_token_ids must be in [0, {vocab})", param="stop_token_ids")
    if vocab is not None and any(not 0 <= t < vocab for t in logit_bias or {}):
        raise errors.bad_request(f"logit_bias keys must be token ids in [0, {vocab})", param="logit_bias")


def check_engine(prompt_ids: list[int], params: SamplingParams,
                 engine_check: Callable[[list[int], SamplingParams], None] | None) -> None:
    """The engine's own check (e.g. "needs more KV than the whole cache") as a 400, before any stream starts."""
    try:
        params.validate()
        if engine_check is not None:
            engine_check(prompt_ids, params)
    except ValueError as e:
        raise errors.bad_request(str(e)) from None


def checked_params(req: Any, prompt_ids: list[int], max_tokens: int | None, limits: ModelLimits,
                   engine_check: Callable[[list[int], SamplingParams], None] | None = None) -> SamplingParams:
    """Every limit of a validated OpenAI request and its prompt ids, in one place; the engine's params."""
    limit = check_prompt(prompt_ids, max_tokens, limits)
    try:
        params = req.to_sampling_params(limit)
    except ValueError as e:
        raise errors.bad_request(str(e)) from None
    check_stop_ids(params.stop_token_ids, limits, params.logit_bias)
    check_engine(prompt_ids, params, engine_check)
    return params


async def check_grammar(req: Any, params: SamplingParams, compile_grammar: Callable[[SamplingParams], None] | None,
                        jobs: GrammarJobs = JOBS) -> None:
    """A structured-output request's grammar compiles (on the grammar pool, within its budget: api/grammar_jobs;
    the engine caches it for the request itself), else a 400 naming the field that asked for it."""
    if not params.structured_kind:
        return
    asked = req.structured() if req is not None else None
    param = asked[0] if asked else "response_format" if req is not None else "params.structured_spec"
    if compile_grammar is None:
        raise errors.bad_request(f"{param}: structured output is not available on this engine", param=param)
    await jobs.run(compile_grammar, params, param)
