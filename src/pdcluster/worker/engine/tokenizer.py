"""Text <-> token ids via the `tokenizers` library, chat templates via jinja2, streaming detokenization.

A model folder without tokenizer.json still serves token-id prompts: `Tokenizer.from_folder` returns None
and the engine emits ids only.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, tok: _HFTokenizer, config: dict[str, Any] | None = None) -> None:
        self._tok = tok
        self.config = config or {}
        self.chat_template: str | None = self.config.get("chat_template") or None
        if isinstance(self.chat_template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer | None:
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            return None
        try:
            tok = _HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception subclass for malformed files
            raise ValueError(f"{tok_file}: cannot load tokenizer ({e})") from e
        cfg_file = folder / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if cfg_file.is_file():
            try:
                config = json.loads(cfg_file.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{cfg_file}: not valid JSON ({e})") from e
        template_file = folder / "chat_template.jinja"  # newer transformers save the template separately
        if "chat_template" not in config and template_file.is_file():
            config["chat_template"] = template_file.read_text()
        return cls(tok, config)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def vocab_list(self, size: int) -> list[str]:
        """Each id's token string (as the tokenizer stores it, e.g. byte-level "Ġ"), "" for ids it lacks."""
        out = [""] * size
        for token, i in self._tok.get_vocab(with_added_tokens=True).items():
            if 0 <= i < size:
                out[i] = token
        return out

    def backend_json(self) -> str:
        """The tokenizer.json text (what xgrammar reads the vocabulary's encoding from)."""
        return self._tok.to_str()

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """transformers' semantics: ``tools`` and the extra ``kwargs`` (a request's chat_template_kwargs, e.g.
        enable_thinking) are template variables beside messages."""
        if not self.chat_template:
            raise ValueError("this model has no chat template (tokenizer_config.json has no chat_template)")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template error: {message}")

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        # transformers' semantics: jinja's own tojson HTML-escapes (<, >, &, ') and would change the prompt
        env.filters["tojson"] = _tojson
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template).render(
                **kwargs,
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config files
        return value.get("content")
    return value


class IncrementalDetokenizer:
    """Streams text for a growing list of ids without ever emitting half a UTF-8 character: `tokenizers`'
    own `DecodeStream`, which holds a token back while the text it ends with is an incomplete character.

    The stream starts from the last few prompt tokens, so the first output token decodes as it does after its
    real left context (merges, a leading space that Metaspace / byte-level decoders would otherwise drop).
    """

    CONTEXT = 6  # prompt tokens of left context

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        from tokenizers.decoders import DecodeStream

        self.tok = tokenizer
        context = list(prompt_ids[-self.CONTEXT:])
        try:
            self._stream = DecodeStream(ids=context, skip_special_tokens=True)  # tokenizers >= 0.22: prefill
        except TypeError:  # older DecodeStream: feed the context through it and drop that text
            self._stream = DecodeStream(skip_special_tokens=True)
            for t in context:
                self._stream.step(tokenizer._tok, t)

    def step(self, new_ids: list[int]) -> str:
        out = ""
        for t in new_ids:
            out += self._stream.step(self.tok._tok, t) or ""
        return out


def read_chat_template(path: str | Path) -> str:
    """A chat template file (`--chat-template`), checked to parse; ValueError naming the file otherwise."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    file = Path(path)
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {str(path)!r}: cannot read it ({e})") from None
    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template {str(path)!r}: line {e.lineno}: {e.message}") from None
    return text
