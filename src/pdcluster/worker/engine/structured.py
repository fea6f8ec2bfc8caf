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

Compiled grammars live in `GrammarCache`, ours rather than xgrammar's: each entry is measured
(`memory_size_bytes`) and the least recently used are dropped past the byte cap, which therefore holds. A
grammar that admits no output at all (a regex matching nothing, a string pattern no character fits) is a
ValueError at compile time, not an engine error mid-request. Where compiles run, and for how long a request
waits for one, is the API's business (api/grammar_jobs.py): a compile cannot be interrupted once started.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from pdcluster.worker.engine.sampling_params import MAX_STRUCTURED_SPEC, STRUCTURED_KINDS

if TYPE_CHECKING:
    import xgrammar

    from pdcluster.worker.engine.tokenizer import Tokenizer

KINDS = STRUCTURED_KINDS
MAX_SPEC_CHARS = MAX_STRUCTURED_SPEC
CACHE_BYTES = 256 << 20  # compiled grammars kept (GrammarCache)
_FORCED_STEPS = 16  # how far a forced prefix (`"` of a string) is followed when checking a grammar admits output
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
        try:  # the API bounded the spec's nesting already; this guards direct engine use
            schema = json.loads(spec)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"is not valid JSON ({str(e)[:200]})") from None
        if not isinstance(schema, dict | bool):
            raise ValueError("must be a JSON schema (an object)")
        return "json_schema", spec
    if kind == "regex":
        if not spec:
            raise ValueError("must not be empty")
        return "regex", spec
    try:
        choices = json.loads(spec) if spec else None
    except (json.JSONDecodeError, RecursionError):
        choices = None
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


class GrammarCache:
    """Compiled grammars by source, least recently used dropped once their measured size passes `max_bytes`
    (xgrammar's own cache counted less than the grammars held: 880 MB under a 256 MiB cap). Thread-safe."""

    def __init__(self, max_bytes: int = CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[str, str]) -> Any:
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                return None
            self._entries.move_to_end(key)
            return hit[0]

    def put(self, key: tuple[str, str], grammar: Any) -> None:
        size = int(grammar.memory_size_bytes) + len(key[1])
        with self._lock:
            if key in self._entries or size > self.max_bytes:
                return  # a grammar larger than the whole cache is used once and not kept
            self._entries[key] = (grammar, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.bytes -= dropped


class GrammarBackend:
    """The tokenizer's vocabulary as xgrammar sees it and the grammar compiler; both built on first use (a
    large vocabulary takes a while) and safe to use from any thread (compiles run off the event loop)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, stop_token_ids: Iterable[int],
                 cache_bytes: int = CACHE_BYTES) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache = GrammarCache(cache_bytes)
        # compiles on the engine's own path (a grammar the API's check did not leave cached): one at a time,
        # never on the default executor that tokenizes plain requests
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-engine")
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
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def compile(self, kind: str, spec: str) -> xgrammar.CompiledGrammar:
        """The compiled grammar (from the cache when it is there); ValueError with the reason for a bad spec."""
        key = grammar_source(kind, spec)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        how, what = key
        compiler = self._get_compiler()
        try:
            if how == "json_schema":
                grammar = compiler.compile_json_schema(what, any_whitespace=False, strict_mode=True)
            elif how == "regex":
                grammar = compiler.compile_regex(what)
            else:
                grammar = compiler.compile_grammar(what)
        except (RuntimeError, ValueError) as e:  # xgrammar raises RuntimeError for bad schemas / regexes
            raise ValueError(library_message(e)) from None
        self._check_admits_output(grammar)
        self.cache.put(key, grammar)
        return grammar

    def _check_admits_output(self, grammar: xgrammar.CompiledGrammar) -> None:
        """ValueError when no output can start (or get past a forced prefix such as a string's `"`): the
        engine would otherwise find no token to sample and fail the request mid-stream."""
        import xgrammar

        matcher = xgrammar.GrammarMatcher(grammar)
        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        for _ in range(_FORCED_STEPS):
            if matcher.is_terminated():
                return
            matcher.fill_next_token_bitmask(bitmask)
            allowed = unpack_bitmask(bitmask[0], self.vocab_size).nonzero().flatten()
            if len(allowed) == 0:
                raise ValueError("admits no output at all (e.g. a regex or pattern that matches nothing)")
            if len(allowed) > 1 or not matcher.accept_token(int(allowed[0])):
                return

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
