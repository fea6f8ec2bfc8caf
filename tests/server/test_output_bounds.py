"""Issue 38 rows 6 and 11, on what the worker makes of generated output: a tool-call parser reading JSON nested
far deeper than any call's arguments gets text back, not a RecursionError (a 500, an error event mid-stream);
and the legacy completions `top_logprobs` dict, keyed by text, keeps the chosen token's own value when another
top token decodes to the same text (byte-level pieces of one character)."""

from __future__ import annotations

from pdcluster.worker.api.shaping import completion_logprobs
from pdcluster.worker.api.tool_calls import ToolCallStream, ToolPlan, merge_deltas, parse_whole


def test_hermes_block_of_1400_brackets_is_text_not_a_500() -> None:
    text = "<tool_call>" + "[" * 1400 + "</tool_call>"
    content, calls = parse_whole(ToolPlan("auto", parser="hermes"), text)
    assert calls is None and content is not None and content.startswith("<tool_call>[[[")
    stream = ToolCallStream(ToolPlan("auto", parser="hermes"))  # streamed, in pieces: the same answer
    deltas = [d for i in range(0, len(text), 7) for d in stream.feed(text[i:i + 7])] + stream.finish()
    assert merge_deltas(deltas)[1] is None


def test_required_call_whose_arguments_nest_1400_deep_does_not_raise() -> None:
    # a self-referencing `parameters` lets the grammar nest without end; max_tokens cuts it somewhere
    text = '{"name": "f", "arguments": ' + '{"a": ' * 1400 + "1" + "}" * 1401
    content, calls = parse_whole(ToolPlan("required"), text)
    assert calls is not None and calls[0]["function"]["name"] == "f"


def entry(token_id: int, token: str, logprob: float) -> dict[str, object]:
    return {"token_id": token_id, "token": token, "logprob": logprob, "bytes": list(token.encode())}


def test_two_top_tokens_with_the_same_text_keep_the_chosen_tokens_value() -> None:
    # the chosen token (id 7, -0.3) and a rival byte piece (id 9, -2.0) both decode to U+FFFD
    chosen = {**entry(7, "\ufffd", -0.3), "top": [entry(7, "\ufffd", -0.3), entry(9, "\ufffd", -2.0)]}
    out = completion_logprobs([chosen], 0)
    assert out["token_logprobs"] == [-0.3]
    assert out["top_logprobs"] == [{"\ufffd": -0.3}]
    # the chosen token sampled below a rival that shares its text: its own value still shows under the text
    low = {**entry(9, "\ufffd", -2.0), "top": [entry(7, "\ufffd", -0.3), entry(9, "\ufffd", -2.0),
                                              entry(3, "a", -1.0)]}
    assert completion_logprobs([low], 0)["top_logprobs"] == [{"\ufffd": -2.0, "a": -1.0}]
