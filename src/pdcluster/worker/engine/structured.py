"""Structured output with xgrammar: a grammar per request, compiled once (and cached), a matcher per sequence
that masks the tokens the grammar cannot take next and advances with each accepted token.

The kinds (``SamplingParams.structured_kind``) and what ``structured_spec`` holds for each:

- ``json_object``: any JSON object (``spec`` unused)
- ``json_schema``: the JSON schema, as JSON text
- ``regex``: the regular expression
- ``choice``: a JSON list of the allowed strings

JSON is generated compact (no free whitespace between tokens): a model that likes blanks cannot loop on them
until max_tokens, and the output is what ``json.dumps`` would write. The matcher has no state that cannot be
rebuilt from the output: a decode worker continuing a request (a KV transfer or a resume) replays the output
tokens so far into a fresh matcher, so every path masks the same way.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pdcluster.worker.engine.sampling_params import MAX_STRUCTURED_SPEC, STRUCTURED_KINDS

if TYPE_CHECKING:
    import xgrammar

    from pdcluster.worker.engine.tokenizer import Tokenizer

KINDS = STRUCTURED_KINDS
MAX_SPEC_CHARS = MAX_STRUCTURED_SPEC
_CACHE_BYTES = 256 << 20  # compiled grammars kept (xgrammar's own LRU cache)
_LIB_PREFIX = re.compile(r"^\[[0-9:]+\] \S+\.cc:\d+: (Check failed: .*? is false: )?")


def grammar_source(kind: str, spec: str) -> tuple[str, str]:
    """(how to compile, what) for a request's kind and spec; ValueError for a spec that is not well formed."""
    if kind not in KINDS:
        raise ValueError(f"unknown structured output kind {kind!r}")
    if len(spec) > MAX_SPEC_CHARS:
        raise ValueError(f"is longer than {MAX_SPEC_CHARS} characters")
    if kind == "json_object":
        return "json_schema", json.dumps({"type": "object"})
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"is not valid JSON ({e})") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("must be a JSON schema (an object)")
        return "json_schema", spec
    if kind == "regex":
        if not spec:
            raise ValueError("must not be empty")
        return "regex", spec
    choices = json.loads(spec) if spec else None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("must be a non-empty list of non-empty strings")
    # EBNF string literals take JSON's escapes, so json.dumps quotes any choice exactly
    return "ebnf", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def library_message(e: BaseException) -> str:
    """xgrammar's error text without its C++ file:line prefix."""
    return _LIB_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's int32 bitmask ``[ceil(V/32)]`` (bit j of word i = token 32*i+j allowed) -> bool ``[V]``."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.reshape(-1, 1) >> shifts) & 1
    return bits.reshape(-1)[:vocab_size].bool()


class GrammarState:
    """One sequence's matcher: which tokens may come next, advanced with each token the sequence takes."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, vocab_size: int) -> None:
        import xgrammar

        self.matcher = matcher
        self.vocab_size = vocab_size
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and took its stop token: the request is done."""
        return bool(self.matcher.is_terminated())

    def allowed(self) -> torch.Tensor | None:
        """Bool ``[vocab]`` of the tokens the grammar accepts next (None once terminated: nothing to mask)."""
        if self.terminated:
            return None
        self.matcher.fill_next_token_bitmask(self._bitmask)
        return unpack_bitmask(self._bitmask[0], self.vocab_size)

    def accept(self, token: int) -> None:
        if self.terminated:
            return
        if not self.matcher.accept_token(token):
            raise ValueError(f"token {token} does not fit the request's grammar")


class GrammarBackend:
    """The tokenizer's vocabulary as xgrammar sees it and the grammar compiler; both built on first use (a
    large vocabulary takes a while) and safe to use from any thread (compiles run off the event loop)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                if self.tokenizer is None:
                    raise ValueError("needs the model's tokenizer (this model folder has no tokenizer.json)")
                info = xgrammar.TokenizerInfo(
                    self.tokenizer.vocab_list(self.vocab_size),
                    **_vocab_metadata(self.tokenizer.backend_json()),
                    vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids or None,
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_limit_bytes=_CACHE_BYTES)
            return self._compiler

    def compile(self, kind: str, spec: str) -> xgrammar.CompiledGrammar:
        """The compiled grammar (cached by xgrammar); ValueError with the reason for a bad spec."""
        how, what = grammar_source(kind, spec)
        compiler = self._get_compiler()
        try:
            if how == "json_schema":
                return compiler.compile_json_schema(what, any_whitespace=False, strict_mode=True)
            if how == "regex":
                return compiler.compile_regex(what)
            return compiler.compile_grammar(what)
        except (RuntimeError, ValueError) as e:  # xgrammar raises RuntimeError for bad schemas / regexes
            raise ValueError(library_message(e)) from None

    def state(self, kind: str, spec: str, replay: Sequence[int] = ()) -> GrammarState:
        """A fresh matcher, advanced over ``replay`` (output tokens another worker already produced)."""
        import xgrammar

        state = GrammarState(xgrammar.GrammarMatcher(self.compile(kind, spec)), self.vocab_size)
        for t in replay:
            state.accept(t)
        return state


def _vocab_metadata(backend_json: str) -> dict[str, Any]:
    """vocab_type / add_prefix_space of a `tokenizers` tokenizer, detected as xgrammar's from_huggingface does
    (without needing transformers)."""
    import xgrammar

    meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(backend_json)
    return {"vocab_type": meta["vocab_type"], "add_prefix_space": bool(meta["add_prefix_space"])}
