"""engine/structured.py's bounds (issue 38 rows 8 and 12): the compiled-grammar cache holds its byte cap by
measuring what it keeps, and a grammar that admits no output at all is refused when it compiles (a 400 at the
API) instead of failing the request mid-stream (a 500, and three retries through the router)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdcluster.worker.engine.structured import GrammarBackend, GrammarCache
from pdcluster.worker.engine.tokenizer import Tokenizer
from pdcluster.worker.local.demo_model import build_demo_model


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> GrammarBackend:
    folder = build_demo_model(tmp_path_factory.mktemp("grammar-model"), num_hidden_layers=1)
    tok = Tokenizer.from_folder(Path(folder))
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    return GrammarBackend(tok, vocab, [0])


def schema(i: int) -> str:
    """Distinct schemas of similar size (the attack's ~100 distinct 26 KB schemas, scaled down)."""
    return json.dumps({"type": "object", "required": [f"k{i}_{j}" for j in range(8)],
                       "properties": {f"k{i}_{j}": {"type": "string", "maxLength": 5 + j} for j in range(8)}})


def test_the_cache_holds_its_byte_cap_and_drops_the_least_recently_used(backend: GrammarBackend) -> None:
    one = backend.compile("json_schema", schema(0)).memory_size_bytes
    cache = GrammarCache(max_bytes=4 * one)
    backend.cache, old = cache, backend.cache
    try:
        for i in range(12):
            backend.compile("json_schema", schema(i))
            assert cache.bytes <= cache.max_bytes
        assert 1 <= len(cache) < 12
        kept = backend.compile("json_schema", schema(11))
        assert backend.compile("json_schema", schema(11)) is kept  # a hit, not a recompile
        backend.compile("json_schema", schema(0))  # long evicted: compiled again, and kept
        assert cache.get(("json_schema", schema(0))) is not None
    finally:
        backend.cache = old


def test_a_grammar_larger_than_the_whole_cache_is_used_and_not_kept(backend: GrammarBackend) -> None:
    cache = GrammarCache(max_bytes=16)
    backend.cache, old = cache, backend.cache
    try:
        assert backend.compile("json_schema", schema(1)) is not None
        assert len(cache) == 0 and cache.bytes == 0
    finally:
        backend.cache = old


@pytest.mark.parametrize("kind,spec", [
    ("regex", r"[^\s\S]"),  # matches no character at all
    ("json_schema", json.dumps({"type": "string", "pattern": r"[^\s\S]"})),  # past the forced `"`, nothing
])
def test_a_grammar_that_admits_no_output_is_a_value_error(backend: GrammarBackend, kind: str, spec: str) -> None:
    with pytest.raises(ValueError, match="admits no output"):
        backend.compile(kind, spec)


@pytest.mark.parametrize("spec", [{"type": "string", "minLength": 5, "maxLength": 2},
                                  {"type": "array", "minItems": 3, "maxItems": 1},
                                  {"type": "integer", "minimum": 5, "maximum": 2}])
def test_contradictory_bounds_are_a_value_error(backend: GrammarBackend, spec: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        backend.compile("json_schema", json.dumps(spec))


def test_ordinary_grammars_still_compile(backend: GrammarBackend) -> None:
    for kind, spec in [("regex", "[a-z]{1,4}"), ("choice", '["yes", "no"]'), ("json_object", ""),
                       ("json_schema", json.dumps({"type": "string", "maxLength": 3}))]:
        assert backend.compile(kind, spec) is not None


def test_a_grammar_dead_end_mid_stream_is_the_clients_400(backend: GrammarBackend) -> None:
    # past what the compile-time check follows, the engine fails the request with GrammarState.accept's words;
    # the API maps exactly those onto a 400 (and the router passes it on instead of retrying elsewhere)
    from pdcluster.worker.api.errors import GRAMMAR_MISFIT, engine_failure

    state = backend.state("regex", "ab")
    refused = next(t for t in range(backend.vocab_size) if not bool(state.allowed()[t]))  # type: ignore[index]
    with pytest.raises(ValueError) as e:
        state.accept(refused)
    assert GRAMMAR_MISFIT in str(e.value)
    assert engine_failure(f"ValueError: {e.value}").status == 400
    assert engine_failure("ValueError: sampling failed").status == 500
