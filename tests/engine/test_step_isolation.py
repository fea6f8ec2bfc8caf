"""An engine step never dies of one request's data: a request whose processing raises (its stop list, its
sampling settings) fails alone with an error; the other requests of the same batch go on, token-identical."""

from __future__ import annotations

import asyncio

import pytest

from pdcluster.worker.engine.async_engine import AsyncEngine
from pdcluster.worker.engine.sampling_params import SamplingParams

from .conftest import prompt_of

GOOD = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _corrupt(params: SamplingParams, how: str) -> None:
    # Past validation (as if an internal caller's params slipped through): the step must still survive it.
    if how == "stop":
        params.stop = 5  # type: ignore[assignment]  # StopText iterates it: TypeError
    else:
        params.temperature, params.top_k = 1.0, "x"  # type: ignore[assignment]  # the sampler compares it


@pytest.mark.parametrize("how", ["stop", "sampling"])
def test_bad_request_fails_alone_in_the_engine(make_engine, how):
    want = make_engine().generate([prompt_of(9, seed=1), prompt_of(14, seed=2)], GOOD)
    engine = make_engine()
    engine.add_request("good1", prompt_of(9, seed=1), GOOD)
    bad = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("bad", prompt_of(12, seed=3), bad)
    engine.add_request("good2", prompt_of(14, seed=2), GOOD)
    _corrupt(bad, how)
    got: dict[str, list[int]] = {"good1": [], "good2": [], "bad": []}
    last = {}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            last[out.request_id] = out
    assert [got["good1"], got["good2"]] == want
    assert last["bad"].finished and last["bad"].finish_reason == "error" and last["bad"].error
    assert last["good1"].finish_reason == last["good2"].finish_reason == "length"
    assert "bad" not in engine.seqs  # its blocks are back (make_engine checks for leaks)


async def test_bad_request_fails_alone_through_the_async_engine(make_engine):
    aengine = AsyncEngine(make_engine())
    try:
        want = make_engine().generate([prompt_of(20, seed=5)], SamplingParams(max_tokens=30, temperature=0.0,
                                                                               ignore_eos=True))[0]
        good = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)

        async def run(rid: str, prompt: list[int], params: SamplingParams) -> tuple[list[int], object]:
            toks, last = [], None
            async for out in aengine.generate(rid, prompt, params):
                toks += out.new_token_ids
                last = out
            return toks, last

        task = asyncio.ensure_future(run("good", prompt_of(20, seed=5), good))
        await asyncio.sleep(0.05)
        # long enough that it is still running when the corruption lands, however fast the steps go
        bad = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        bad_task = asyncio.ensure_future(run("bad", prompt_of(7, seed=6), bad))
        while not await aengine.call(lambda e: "bad" in e.seqs):  # admitted (validated) first
            await asyncio.sleep(0.001)
        await aengine.call(lambda e: _corrupt(bad, "stop"))
        (toks, last), (_, bad_last) = await asyncio.gather(task, bad_task)
        assert toks == want and last.finish_reason == "length"
        assert bad_last.finish_reason == "error" and "TypeError" in bad_last.error
    finally:
        aengine.shutdown()
