"""The plain stream chunk (no logprobs, no tool calls) is written without the pydantic models, for speed: it
must be byte for byte what the models write, for any text, model name, finish reason and token ids."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdcluster.worker.api.responses import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
)
from pdcluster.worker.api.shaping import Shaper, sse

# Any text a detokenizer can produce: every code point but lone surrogates (not valid UTF-8 either way)
TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)


def _model_chunk(sh: Shaper, text: str, ids: list[int] | None, reason: str | None, index: int) -> str:
    if sh.kind == "chat":
        delta = ChatDelta(content=text) if text else ChatDelta()
        return sse(ChatCompletionChunk(id=sh.rid, model=sh.model, created=sh.created, choices=[
            ChatChunkChoice(index=index, delta=delta, finish_reason=reason, token_ids=ids)]))
    return sse(CompletionResponse(id=sh.rid, model=sh.model, created=sh.created, choices=[
        CompletionChoice(index=index, text=text, finish_reason=reason, token_ids=ids)]))


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(["completions", "chat"]), model=TEXT, text=TEXT,
       ids=st.none() | st.lists(st.integers(0, 1 << 31), max_size=4),
       reason=st.sampled_from([None, "stop", "length", "abort"]), index=st.integers(0, 9))
def test_plain_chunk_is_the_models_json(kind: str, model: str, text: str, ids: list[int] | None,
                                        reason: str | None, index: int) -> None:
    sh = Shaper(kind, model, 3, return_token_ids=ids is not None)  # type: ignore[arg-type]
    for _ in range(2):  # the second chunk reuses the head the first one built
        got = sh.chunk(text, ids or [], reason, index)
        assert got == _model_chunk(sh, text, ids, reason, index)
        assert got.encode("utf-8")  # what the response sends


def test_logprobs_still_go_through_the_models() -> None:
    sh = Shaper("completions", "m", 1, logprobs=True)
    out = sh.chunk("a", [5], None, 0, [{"token": "a", "logprob": -0.5, "top": []}])
    assert '"token_logprobs":[-0.5]' in out
