"""Turn an OpenAI prompt or chat conversation into token ids, via whatever tokenizer the engine has.

The engine's tokenizer is used through a small duck-typed surface (`encode`,
`apply_chat_template` or a `chat_template` string) so the server does not depend on its exact
class. A model without a tokenizer serves token-id prompts only: text is a 400, not a crash.
"""

from __future__ import annotations

from typing import Any

from pdcluster.worker.api import errors

# Used when the model ships no chat template: plain, documented, and good enough for demos.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _ids(result: Any) -> list[int]:
    ids = getattr(result, "ids", result)  # tokenizers.Encoding or a plain list
    return [int(t) for t in ids]


def encode_text(tokenizer: Any, text: str, *, add_special_tokens: bool = True) -> list[int]:
    if tokenizer is None:
        raise errors.bad_request(
            "this model has no tokenizer (no tokenizer.json): send the prompt as a list of token ids",
            param="prompt", code="no_tokenizer",
        )
    try:
        return _ids(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except TypeError:  # an encode() without the keyword
        return _ids(tokenizer.encode(text))


def encode_prompt(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return encode_text(tokenizer, prompt)
    return list(prompt)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None,
                max_chars: int | None = None) -> list[int]:
    """Apply the model's chat template (from tokenizer_config.json, or --chat-template) and tokenize the result.
    ``tools`` and ``template_kwargs`` (chat_template_kwargs) are template variables, as in transformers.
    ``max_chars``: a rendered text longer than this is a 400 before it is tokenized (the caller has capped the
    template's input already; this bounds what a template makes of it)."""
    extra: dict[str, Any] = {**(template_kwargs or {})}
    if tools is not None:
        extra["tools"] = tools
    if tokenizer is None:
        raise errors.bad_request(
            "this model has no tokenizer, so chat completions are unavailable; use /v1/completions with token ids",
            code="no_tokenizer",
        )
    apply = getattr(tokenizer, "apply_chat_template", None)
    # A tokenizer that says it has no template gets the fallback instead of a 400.
    has_template = getattr(tokenizer, "chat_template", True)
    try:
        if callable(apply) and has_template:
            rendered = apply(messages, add_generation_prompt=add_generation_prompt, **extra)
        else:
            rendered = render_template(
                getattr(tokenizer, "chat_template", None) or FALLBACK_TEMPLATE,
                messages,
                add_generation_prompt,
                bos_token=getattr(tokenizer, "bos_token", None) or "",
                eos_token=getattr(tokenizer, "eos_token", None) or "",
                **extra,
            )
    except errors.APIError:
        raise
    except Exception as e:  # templates raise on e.g. role order they do not accept
        raise errors.bad_request(f"cannot apply the chat template: {e}", param="messages") from None
    if isinstance(rendered, str) and max_chars is not None and len(rendered) > max_chars:
        raise errors.bad_request(f"messages: the rendered conversation has {len(rendered)} characters, more than "
                                 f"the {max_chars} that could fit the model's context", param="messages",
                                 code="context_length_exceeded")
    if isinstance(rendered, str):
        # The template already places BOS and other special tokens.
        return encode_text(tokenizer, rendered, add_special_tokens=False)
    return _ids(rendered)


def render_template(
    template: str, messages: list[dict[str, Any]], add_generation_prompt: bool, **special: Any
) -> str:
    # Sandboxed: a chat template is data from the model folder, not trusted code.
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **special
    )
