"""Prompt and chat-template handling against the duck-typed tokenizer surface."""

from __future__ import annotations

import pytest

from pdcluster.worker.api import errors
from pdcluster.worker.api.prompting import encode_prompt, render_chat

from .fake_engine import CharTokenizer


class NoTemplate(CharTokenizer):
    chat_template = None  # type: ignore[assignment]

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        raise ValueError("this model has no chat template")


def decode(ids: list[int]) -> str:
    return CharTokenizer().decode(ids)


def test_model_template_is_used() -> None:
    ids = render_chat(CharTokenizer(), [{"role": "user", "content": "hi"}])
    assert decode(ids) == "<user>hi<assistant>"


def test_fallback_template_when_the_model_has_none() -> None:
    ids = render_chat(NoTemplate(), [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert decode(ids) == "system: s\nuser: u\nassistant:"


def test_template_errors_are_400() -> None:
    class Strict(CharTokenizer):
        chat_template = "{{ raise_exception('roles must alternate') }}"

    with pytest.raises(errors.APIError) as e:
        render_chat(Strict(), [{"role": "user", "content": "x"}])
    assert e.value.status == 400 and "roles must alternate" in e.value.message


def test_no_tokenizer_is_400_for_text_but_ids_pass() -> None:
    with pytest.raises(errors.APIError) as e:
        encode_prompt(None, "text")
    assert e.value.status == 400 and e.value.code == "no_tokenizer"
    assert encode_prompt(None, [1, 2]) == [1, 2]
