"""served_vs_hf's token check: a difference from HF's batched generate is excused only when HF alone agrees."""

from __future__ import annotations

import pytest

from benchmarks import served_vs_hf


def test_only_hf_alone_can_excuse_a_difference(monkeypatch: pytest.MonkeyPatch) -> None:
    alone = {(1, 2): [5, 6], (3, 4): [7, 8]}
    monkeypatch.setattr(served_vs_hf, "hf_run", lambda hf, prompts, new: (0.0, 0.0, [alone[tuple(prompts[0])]]))
    prompts = [[1, 2], [3, 4]]
    batched = [[5, 6], [7, 9]]  # HF's batched run flipped request 1's second token
    check = served_vs_hf.check_tokens
    assert check(None, prompts, batched, {"served": batched}, 2) == 0
    assert check(None, prompts, batched, {"served": [[5, 6], [7, 8]], "in-process": [[5, 6], [7, 8]]}, 2) == 1
    with pytest.raises(AssertionError, match="request 1: in-process"):
        check(None, prompts, batched, {"served": [[5, 6], [7, 8]], "in-process": [[5, 6], [7, 0]]}, 2)
    with pytest.raises(AssertionError, match="request 0: served"):
        check(None, prompts, batched, {"served": [[5, 0], [7, 9]]}, 2)
