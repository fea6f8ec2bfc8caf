"""Greedy steps answered by the bf16-screened head (worker/engine/greedy_head.py): the same tokens as HF
generate and as the whole fp32 head, whether the screen decides a row or hands it back."""

from __future__ import annotations

from pdcluster.kernels import native
from pdcluster.worker.engine.sampling_params import SamplingParams
from tests.native_marks import needs_screen

from .conftest import GREEDY, hf_greedy, prompt_of

pytestmark = needs_screen

LENGTHS = [1, 2, 15, 16, 17, 33, 100]
LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _run(engine, prompts, params=LONG) -> dict[str, list[int]]:
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    toks: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for out in engine.step():
            toks[out.request_id] += out.new_token_ids
    return toks


def test_continuous_batch_matches_hf_through_the_screen(make_engine, tiny_model_dir, monkeypatch) -> None:
    monkeypatch.setattr(native, "screen_max_rows", lambda: 64)  # every step screened, not only those of up to 6
    engine = make_engine(max_batch_tokens=64)
    prompts = {f"r{n}": prompt_of(n, seed=n) for n in LENGTHS}
    toks = _run(engine, prompts)
    head = engine.runner.model._greedy
    assert head is not None and head.screened and head.max_rows == 64, "the tiny model's head is screened"
    for rid, p in prompts.items():
        assert toks[rid] == hf_greedy(tiny_model_dir, p, LONG.max_tokens)[0], rid


def test_screen_off_and_every_row_handed_back_give_the_same_tokens(make_engine, monkeypatch) -> None:
    prompts = {f"r{n}": prompt_of(n, seed=100 + n) for n in LENGTHS}
    monkeypatch.setattr(native, "screen_max_rows", lambda: 64)
    screened = _run(make_engine(max_batch_tokens=64), prompts)
    monkeypatch.setattr(native, "SCREEN_MAX_CANDIDATES", 0)  # the screen decides no row: all go to the fp32 head
    handed_back = _run(make_engine(max_batch_tokens=64), prompts)
    monkeypatch.setenv(native.SWITCH, "-screen")
    off = _run(make_engine(max_batch_tokens=64), prompts)
    assert screened == handed_back == off


def test_rows_that_read_logits_still_get_them(make_engine) -> None:
    # a greedy request beside one asking for logprobs: that step runs the whole head for both
    engine = make_engine()
    engine.add_request("plain", prompt_of(9, seed=1), GREEDY)
    engine.add_request("lp", prompt_of(9, seed=1), SamplingParams(max_tokens=12, temperature=0.0,
                                                                   ignore_eos=True, logprobs=2))
    toks: dict[str, list[int]] = {"plain": [], "lp": []}
    logprobs = []
    while engine.has_unfinished():
        for out in engine.step():
            toks[out.request_id] += out.new_token_ids
            if out.request_id == "lp":
                logprobs.append(out.logprobs)
    assert toks["plain"] == toks["lp"]
    assert len(logprobs) == 12 and all(lp for lp in logprobs)


def test_the_switch_at_start_builds_no_screen(make_engine, monkeypatch) -> None:
    monkeypatch.setenv(native.SWITCH, "-screen")
    engine = make_engine()
    assert not engine.runner.model._greedy.screened
    assert _run(engine, {"r": prompt_of(5, seed=3)}, GREEDY)["r"]
