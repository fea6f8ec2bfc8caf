"""Structured output: the bitmask -> allowed-token mask, the mask in the sampler, the engine's outputs following
the grammar, and a continuation elsewhere (KV import, resume) masking exactly as one engine alone."""

from __future__ import annotations

import json
import re

import pytest
import torch
import xgrammar

from pdcluster.worker.engine.sampler import History, sample, shape_logits
from pdcluster.worker.engine.sampling_params import SamplingParams
from pdcluster.worker.engine.structured import grammar_source, library_message, unpack_bitmask
from tests.kv_read import export_kv

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z ]{1,6}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}


def _valid(obj: object) -> bool:
    """SCHEMA's rules, checked by hand (no jsonschema dependency)."""
    return (isinstance(obj, dict) and set(obj) == {"name", "age", "ok"} and isinstance(obj["name"], str)
            and re.fullmatch("[a-z ]{1,6}", obj["name"]) is not None
            and type(obj["age"]) is int and 0 <= obj["age"] <= 120
            and isinstance(obj["ok"], bool))


def test_unpack_bitmask_matches_xgrammar_apply() -> None:
    gen = torch.Generator().manual_seed(0)
    for vocab in (1, 31, 32, 33, 1000):
        words = (vocab + 31) // 32
        bm = torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, generator=gen)
        logits = torch.zeros(vocab)
        xgrammar.apply_token_bitmask_inplace(logits, bm, vocab_size=vocab)
        assert torch.equal(unpack_bitmask(bm, vocab), logits == 0)


def test_grammar_sources_and_bad_specs() -> None:
    how, ebnf = grammar_source("choice", json.dumps(['say "hi"', "a\\b\n", "é"]))
    assert how == "ebnf" and ebnf == 'root ::= "say \\"hi\\"" | "a\\\\b\\n" | "é"'
    assert grammar_source("json_object", "")[0] == "json_schema"
    for kind, spec in [("choice", "[]"), ("choice", '[""]'), ("json_schema", "{bad"), ("json_schema", "[1]"),
                       ("regex", ""), ("nope", "x")]:
        with pytest.raises(ValueError):
            grammar_source(kind, spec)
    msg = library_message(RuntimeError("[11:46:39] /project/cpp/regex_converter.cc:94: Regex parsing error"))
    assert msg == "Regex parsing error"


def test_mask_is_applied_last_and_wins_over_min_tokens() -> None:
    row = torch.zeros(8)
    allowed = torch.tensor([False, True, False, True, False, False, False, False])
    p = SamplingParams(temperature=0.0, logit_bias={2: 100.0}, structured_kind="regex", structured_spec="x")
    out = shape_logits(row, p, History([], [], {7}, allowed), 0)
    assert torch.isinf(out[~allowed]).all() and torch.isfinite(out[allowed]).all()  # bias cannot revive 2
    # min_tokens would mask the only token the grammar allows (its end): the grammar wins
    only_end = torch.zeros(8, dtype=torch.bool)
    only_end[7] = True
    p2 = SamplingParams(max_tokens=4, min_tokens=3, structured_kind="regex", structured_spec="x")
    assert sample(row[None], [p2], [0], [History([], [], {7}, only_end)]) == [7]
    # otherwise min_tokens still holds the end back
    allowed[7] = True
    for _ in range(5):
        assert sample(row[None], [p2], [0], [History([], [], {7}, allowed)])[0] in (1, 3)


def _text(engine, prompt: str, params: SamplingParams) -> tuple[list[int], str]:
    ids = engine.generate([engine.tokenizer.encode(prompt)], params)[0]
    return ids, engine.tokenizer.decode(ids)


def test_engine_outputs_follow_schema_regex_and_choice(make_engine) -> None:
    engine = make_engine()
    for seed in range(3):
        for temperature in (0.0, 1.0):
            p = SamplingParams(max_tokens=80, temperature=temperature, seed=seed, structured_kind="json_schema",
                               structured_spec=json.dumps(SCHEMA))
            _, text = _text(engine, f"person {seed}", p)
            assert _valid(json.loads(text)), text
        _, text = _text(engine, "code", SamplingParams(max_tokens=40, seed=seed, structured_kind="regex",
                                                        structured_spec="[a-c]{3}-[0-9]{2,4}"))
        assert re.fullmatch("[a-c]{3}-[0-9]{2,4}", text), text
        _, text = _text(engine, "?", SamplingParams(max_tokens=10, seed=seed, structured_kind="choice",
                                                     structured_spec=json.dumps(["yes", "no", "maybe"])))
        assert text in ("yes", "no", "maybe")
    _, text = _text(engine, "hello", SamplingParams(max_tokens=80, temperature=0.0, structured_kind="json_object"))
    assert isinstance(json.loads(text), dict)
    # the grammar's end stops the request even with ignore_eos (nothing may follow the JSON)
    ids, text = _text(engine, "x", SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True,
                                                   structured_kind="choice", structured_spec='["ok"]'))
    assert text == "ok" and ids[-1] in engine.eos_token_ids


def test_resume_and_import_replay_the_grammar(make_engine) -> None:
    """A request continued from its first k output tokens (a resume) and one whose first token came from a
    prefill worker (KV import) give what one engine alone gave: the matcher was rebuilt by replay."""
    engine = make_engine()
    spec = json.dumps(SCHEMA)
    p = SamplingParams(max_tokens=60, temperature=1.0, seed=5, structured_kind="json_schema", structured_spec=spec)
    prompt = engine.tokenizer.encode("resume me")
    whole = engine.generate([prompt], p)[0]
    k = 6
    rest = SamplingParams(**{**p.__dict__, "max_tokens": p.max_tokens - k, "first_output_index": k})
    assert whole[:k] + engine.generate([prompt + whole[:k]], rest)[0] == whole
    with pytest.raises(ValueError, match="does not fit"):  # a resume whose output breaks the grammar
        engine.add_request("bad", prompt + engine.tokenizer.encode("nope"),
                           SamplingParams(**{**p.__dict__, "first_output_index": 2}))

    prefill = make_engine()
    prefill.add_request("r", prompt, p, prefill_only=True)
    first = None
    while first is None:
        first = next((o.new_token_ids[0] for o in prefill.step() if o.new_token_ids), None)
    kv = [export_kv(prefill, "r", layer) for layer in range(prefill.model_config.num_layers)]
    prefill.release("r")
    decode = make_engine()
    assert decode.reserve_for_import("r", prompt, p)
    for layer, (kk, vv) in enumerate(kv):
        decode.import_kv_layer("r", layer, kk, vv)
    decode.commit_import("r", first)
    got: list[int] = []
    while decode.has_unfinished():
        for out in decode.step():
            got += out.new_token_ids
    assert got == whole and _valid(json.loads(engine.tokenizer.decode(got)))


def test_bad_specs_are_value_errors_naming_the_reason(make_engine) -> None:
    engine = make_engine()
    for kind, spec, words in [("regex", "a(", "parenthesis"), ("json_schema", '{"type": "nope"}', "nope"),
                              ("json_schema", '{"properties": {"a": {"$ref": "#/x"}}}', "x")]:
        with pytest.raises(ValueError, match=words) as e:
            engine.compile_grammar(SamplingParams(structured_kind=kind, structured_spec=spec))
        assert ".cc:" not in str(e.value)
    assert not engine.seqs
