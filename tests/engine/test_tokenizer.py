"""Tokenizer, chat template, and streaming detokenization that never splits a UTF-8 character."""

from __future__ import annotations

from pdcluster.worker.engine.sampling_params import SamplingParams
from pdcluster.worker.engine.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "naïve café — déjà vu: 日本語のテキスト 🙂🚀 def f(x): return x"


def test_roundtrip_and_chat_template(tiny_model_dir):
    tok = Tokenizer.from_folder(tiny_model_dir)
    assert tok is not None and tok.vocab_size == 1024
    assert tok.decode(tok.encode(TEXT)) == TEXT
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>assistant\n") and "hi" in text


def test_no_tokenizer_folder(tiny_model_dir_no_tokenizer):
    assert Tokenizer.from_folder(tiny_model_dir_no_tokenizer) is None


def test_incremental_detokenization_never_splits_utf8(tiny_model_dir):
    tok = Tokenizer.from_folder(tiny_model_dir)
    ids = tok.encode(TEXT)
    # the byte-level vocabulary must split some multi-byte characters across tokens for this to mean much
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, tok.encode("prompt:"))
    pieces = [detok.step([i]) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == TEXT


def test_engine_streams_text_and_honours_stop_strings(make_engine):
    engine = make_engine()
    tok = engine.tokenizer
    prompt = tok.encode("def main():")
    engine.add_request("a", prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    ids, text = [], ""
    while engine.has_unfinished():
        for out in engine.step():
            ids += out.new_token_ids
            text += out.new_text
    assert text == tok.decode(ids)
    stop = text[10:13]
    assert stop and text.find(stop) == 10, "pick a stop string whose first occurrence is at 10"
    engine.add_request(
        "b", prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
    )
    text_b, reason = "", None
    while engine.has_unfinished():
        for out in engine.step():
            text_b += out.new_text
            reason = out.finish_reason
    assert text_b == text[:10] and reason == "stop"


def test_chat_template_tojson_does_not_html_escape_and_has_strftime_now(tiny_model_dir):
    from pdcluster.worker.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(tiny_model_dir)
    tok.chat_template = "{{ messages[0]['content'] | tojson }}|{{ strftime_now('%Y') }}"
    out = tok.apply_chat_template([{"role": "user", "content": "<a & 'b'> é"}])
    import datetime

    assert out == f"\"<a & 'b'> é\"|{datetime.datetime.now().year}"  # as transformers renders it


def test_chat_template_sees_tools_and_kwargs(tiny_model_dir):
    from pdcluster.worker.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(tiny_model_dir)
    tok.chat_template = ("{% if tools %}[{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}]"
                         "{% endif %}{{ messages[0]['content'] }}{% if enable_thinking is defined %}"
                         "/think={{ enable_thinking }}{% endif %}")
    msgs = [{"role": "user", "content": "q"}]
    assert tok.apply_chat_template(msgs) == "q"
    tools = [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]
    assert tok.apply_chat_template(msgs, tools=tools, enable_thinking=False) == "[f,g]q/think=False"


def test_incremental_detokenizer_is_decode_stream_with_left_context(tiny_model_dir):
    """The first output token decodes after its prompt context (a leading space survives), and the pieces of
    any generated text join to what decoding it whole gives."""
    import random

    tok = Tokenizer.from_folder(tiny_model_dir)
    detok = IncrementalDetokenizer(tok, tok.encode("hello"))
    assert "".join(detok.step([i]) for i in tok.encode(" world")) == " world"
    rng = random.Random(0)
    alphabet = "ab é€😀\n<>"
    for _ in range(30):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 20)))
        ids = tok.encode(text)
        detok = IncrementalDetokenizer(tok, tok.encode("x"))
        pieces = [detok.step([i]) for i in ids]
        assert "".join(pieces) == tok.decode(ids) and all("\ufffd" not in p for p in pieces)
