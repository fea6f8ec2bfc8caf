"""AsyncEngine: concurrent streams, abort frees blocks, early exit from the iterator aborts, errors."""

from __future__ import annotations

import asyncio

import pytest

from pdcluster.worker.engine.async_engine import AsyncEngine
from pdcluster.worker.engine.sampling_params import SamplingParams
from tests.kv_read import export_kv

from .conftest import prompt_of


@pytest.fixture
def aengine(make_engine):
    engine = AsyncEngine(make_engine())
    yield engine
    engine.shutdown()


async def _collect(aengine, rid, prompt, params):
    toks, last = [], None
    async for out in aengine.generate(rid, prompt, params):
        toks += out.new_token_ids
        last = out
    return toks, last


async def test_concurrent_generate_matches_sync(aengine, make_engine):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [prompt_of(n, seed=n) for n in (3, 17, 40)]
    expected = make_engine().generate(prompts, params)
    results = await asyncio.gather(*(_collect(aengine, f"r{i}", p, params) for i, p in enumerate(prompts)))
    assert [t for t, _ in results] == expected
    assert all(last.finished and last.finish_reason == "length" for _, last in results)
    stats = aengine.stats()
    assert stats["kv_cache_used_blocks"] == 0 and stats["generation_tokens_total"] >= 30
    # each native module this process asked for, as /metrics exports it (pdcluster_native_kernel_loaded)
    from pdcluster.kernels import native

    assert {k: v for k, v in stats.items() if k.startswith("native_kernel_loaded:")} == {
        f"native_kernel_loaded:{name}": int(ok) for name, ok in native.outcomes().items()}


async def test_abort_and_disconnect_free_blocks(aengine):
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    gen = aengine.generate("a", prompt_of(50), params)
    first = await gen.__anext__()
    assert first.new_token_ids
    await gen.aclose()  # the client went away
    task = asyncio.create_task(_collect(aengine, "b", prompt_of(20), params))
    await asyncio.sleep(0.05)
    aengine.abort("b")
    toks, last = await asyncio.wait_for(task, 30)
    assert last.finish_reason == "abort"
    used = await aengine.call(lambda e: (len(e.seqs), e.block_manager.num_used_blocks))
    assert used == (0, 0)


async def test_invalid_request_raises_value_error(aengine):
    with pytest.raises(ValueError, match="empty"):
        await _collect(aengine, "x", [], SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        await _collect(aengine, "y", [10**6], SamplingParams())
    with pytest.raises(ValueError, match="model length"):
        await _collect(aengine, "z", [1] * 10, SamplingParams(max_tokens=5000))
    toks, _ = await _collect(aengine, "x", [1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(toks) == 2  # a failed id is reusable, and the engine keeps serving


async def test_step_failure_fails_requests_but_engine_survives(aengine, monkeypatch):
    calls = {"n": 0}
    real = aengine.engine.runner.execute

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real(*a, **kw)

    monkeypatch.setattr(aengine.engine.runner, "execute", flaky)
    toks, last = await _collect(aengine, "a", prompt_of(5), SamplingParams(max_tokens=5, ignore_eos=True))
    assert last.finish_reason == "error" and "boom" in last.error
    toks, last = await _collect(aengine, "b", prompt_of(5), SamplingParams(max_tokens=3, ignore_eos=True))
    assert last.finish_reason == "length" and len(toks) == 3


async def test_imported_request_streams_through_open_stream(aengine, make_engine):
    """The decode side of disaggregation: reserve, import every layer, commit, then stream the tokens."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = prompt_of(21)
    expected = make_engine().generate([prompt], params)[0]
    prefill = make_engine()
    prefill.add_request("p", prompt, params, prefill_only=True)
    first = prefill.step()[0].new_token_ids[0]
    kv = [export_kv(prefill, "p", layer) for layer in range(prefill.model_config.num_layers)]
    prefill.release("p")

    assert await aengine.call(lambda e: e.reserve_for_import("d", prompt, params))
    for layer, (k, v) in enumerate(kv):
        await aengine.call(lambda e, layer=layer, k=k, v=v: e.import_kv_layer("d", layer, k, v))
    stream = aengine.open_stream("d")
    await aengine.call(lambda e: e.commit_import("d", first))
    toks = []
    async for out in stream:
        toks += out.new_token_ids
    assert toks == expected


def test_read_only_accessors(aengine):
    """What the HTTP server needs, without reaching into ``AsyncEngine.engine`` (and without a loop)."""
    engine = aengine.engine
    assert aengine.tokenizer is engine.tokenizer is not None
    assert aengine.model_config is engine.model_config
    assert aengine.max_model_len == engine.max_model_len == 1024
    aengine.validate_request([1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="vocabulary"):
        aengine.validate_request([10**6], SamplingParams())
    with pytest.raises(ValueError, match="model length"):
        aengine.validate_request([1] * 10, SamplingParams(max_tokens=5000))
    assert not engine.seqs  # pure checks: nothing was queued or added
    with pytest.raises(AttributeError):
        aengine.max_model_len = 5  # type: ignore[misc]


async def test_one_event_loop_wakeup_per_step(aengine, monkeypatch):
    """A step's outputs reach their streams in one call_soon_threadsafe, not one per request (the per-output
    wake-ups were event-loop work competing with the next step for the cores)."""
    loop = asyncio.get_running_loop()
    calls = []
    real = loop.call_soon_threadsafe

    def counting(cb, *args, **kw):
        calls.append(cb)
        return real(cb, *args, **kw)

    monkeypatch.setattr(loop, "call_soon_threadsafe", counting)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    n = 4
    await asyncio.gather(*(_collect(aengine, f"w{i}", prompt_of(5, seed=i), params) for i in range(n)))
    steps = aengine.engine.counters["steps"]
    # each add_request's Future also completes through call_soon_threadsafe: n of those at most
    assert len(calls) <= steps + n, (len(calls), steps)


@pytest.mark.parametrize(("raw", "seconds"), [("", 0.01), ("0", 0.0), ("2.5", 0.0025)])
def test_the_drain_wait_is_read_and_checked(monkeypatch, raw, seconds) -> None:
    from pdcluster.worker.engine import async_engine

    monkeypatch.setenv(async_engine.DRAIN_ENV, raw)
    assert async_engine.drain_wait_s() == pytest.approx(seconds)
    for bad in ("soon", "-1", "5000"):
        monkeypatch.setenv(async_engine.DRAIN_ENV, bad)
        with pytest.raises(ValueError, match=async_engine.DRAIN_ENV):
            async_engine.drain_wait_s()
