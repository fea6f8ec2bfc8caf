"""Mixed-precision KV cache: int8/int4 everywhere except ``full_precision_layers``, kept in the model dtype."""

from __future__ import annotations

import pytest
import torch

from pdcluster.kernels import kv_bytes_per_token
from pdcluster.worker.engine.llm_engine import EngineConfig
from pdcluster.worker.engine.sampling_params import SamplingParams
from tests.kv_read import export_kv

from .conftest import prompt_of, run_with_logits

P = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
# chunked prefill (max_batch_tokens=16) so later chunks read their prefix back through the mixed cache
PROMPTS = {"a": prompt_of(40, seed=1), "b": prompt_of(7, seed=2), "c": prompt_of(70, seed=3)}
LAYERS = 3  # the tiny model (tests/conftest.py)


def _run(make_engine, **kw):
    return run_with_logits(make_engine(debug_logits=True, max_batch_tokens=16, **kw), PROMPTS, P)


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_all_layers_full_precision_is_exactly_auto(make_engine, kv):
    ref = _run(make_engine)
    got = _run(make_engine, kv_cache_dtype=kv, full_precision_layers=(0, 1, 2))
    for rid in PROMPTS:
        assert got[rid][0] == ref[rid][0]
        assert torch.equal(got[rid][1], ref[rid][1])


def _mean_error(got, ref, upto: dict[str, int]) -> float:
    return (
        torch.cat([(got[r][1][: upto[r]] - ref[r][1][: upto[r]]).abs().flatten() for r in PROMPTS])
        .mean()
        .item()
    )


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_partial_full_precision_error_lies_between(make_engine, kv):
    ref = _run(make_engine)  # fp32 model, fp32 cache: the reference
    quant = _run(make_engine, kv_cache_dtype=kv)
    mixed = _run(make_engine, kv_cache_dtype=kv, full_precision_layers=(0, 1))
    # Compare only the steps where all three token histories agree (a flipped near-tie changes what follows).
    upto = {}
    for r in PROMPTS:
        n = len(ref[r][0])
        upto[r] = (
            next((i for i in range(n) if not ref[r][0][i] == quant[r][0][i] == mixed[r][0][i]), n - 1) + 1
        )
    err_quant, err_mixed = _mean_error(quant, ref, upto), _mean_error(mixed, ref, upto)
    # Measured on the tiny model: int4 3.7e-3 -> 1.7e-3, int8 2.3e-4 -> 9e-5 (mean |logit error|).
    assert 0.0 < err_mixed < 0.8 * err_quant, (err_mixed, err_quant)


def test_per_layer_formats_and_block_budget(make_engine):
    engine = make_engine(
        num_kv_blocks=None, kv_cache_memory=1 << 20, kv_cache_dtype="int4", full_precision_layers=(0, 2)
    )
    cache, runner = engine.runner.cache, engine.runner
    assert cache.layer_kv_dtypes == ("auto", "int4", "auto")
    assert cache.k[0].dtype == torch.float32 and cache.k_scale[0] is None
    assert cache.k[1].dtype == torch.uint8 and cache.k_scale[1] is not None
    # per-layer sizing: two fp32 layers + one int4 layer, per token, times the block size
    per_token = 2 * kv_bytes_per_token(2, 16, "auto", torch.float32) + kv_bytes_per_token(
        2, 16, "int4", torch.float32
    )
    assert runner.block_bytes == cache.block_bytes == 16 * per_token
    assert cache.num_blocks == (1 << 20) // runner.block_bytes
    # the sizing is what is really allocated
    pools = [t for ts in (cache.k, cache.v, cache.k_scale, cache.v_scale) for t in ts if t is not None]
    assert sum(t.numel() * t.element_size() for t in pools) == cache.num_blocks * runner.block_bytes
    sizes = {
        fp: make_engine(kv_cache_dtype="int4", full_precision_layers=fp, num_kv_blocks=4).runner.block_bytes
        for fp in [(), (0,), (0, 1), (0, 1, 2)]
    }
    assert sizes[()] < sizes[(0,)] < sizes[(0, 1)] < sizes[(0, 1, 2)]
    assert sizes[(0, 1, 2)] == make_engine(num_kv_blocks=4).runner.block_bytes


@pytest.mark.parametrize(
    "layers, match",
    [
        ((-1,), "full_precision_layers"),
        ((LAYERS,), "full_precision_layers.*3 layers"),
        (("0",), "full_precision_layers"),
    ],
)
def test_invalid_layers_are_rejected(make_engine, layers, match):
    with pytest.raises(ValueError, match=match):
        make_engine(kv_cache_dtype="int4", full_precision_layers=layers)
    with pytest.raises(ValueError, match=match):  # checked with auto too: a typo should not wait for int4
        make_engine(full_precision_layers=layers)


def test_string_is_rejected():
    with pytest.raises(ValueError, match="full_precision_layers"):
        EngineConfig(model="m", kv_cache_dtype="int4", full_precision_layers="0,1").validate()  # type: ignore[arg-type]


def test_auto_dtype_makes_it_a_noop(make_engine):
    engine = make_engine(full_precision_layers=(0,))
    assert engine.runner.cache.layer_kv_dtypes == ("auto",) * LAYERS
    assert engine.runner.block_bytes == make_engine().runner.block_bytes


def test_swap_preemption_is_exact(make_engine):
    prompts = [prompt_of(n, seed=n) for n in (20, 9, 33, 14, 25, 17)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    kw = dict(block_size=8, kv_cache_dtype="int4", full_precision_layers=(1,))
    expected = make_engine(**kw).generate(prompts, params)
    engine = make_engine(num_kv_blocks=20, preemption_mode="swap", **kw)
    assert engine.generate(prompts, params) == expected  # swap copies codes, scales and floats as stored
    assert engine.stats()["preemptions_total"] > 0 and engine.runner._host_cache is not None
    assert engine.runner._host_cache.layer_kv_dtypes == ("int4", "auto", "int4")


def test_prefix_cache_hits_with_mixed_precision(make_engine):
    kw = dict(kv_cache_dtype="int4", full_precision_layers=(0,), debug_logits=True)
    base = prompt_of(48, seed=5)
    engine = make_engine(**kw)
    engine.generate([base], P)
    got = run_with_logits(engine, {"x": base + prompt_of(9, seed=6)}, P)["x"]
    assert engine.stats()["prefix_cache_hit_blocks"] >= 3
    # Without the cache the prompt is prefilled fresh (unquantized K/V in-chunk); the hit reads the same
    # 48 tokens back from the mixed cache instead: same tokens, logits within int4 error.
    want = run_with_logits(
        make_engine(enable_prefix_caching=False, **kw), {"x": base + prompt_of(9, seed=6)}, P
    )["x"]
    assert got[0] == want[0]
    assert (got[1] - want[1]).abs().max().item() < 0.3


def _prefill(engine, prompts):
    """Prefill-only; returns each request's exported K/V per layer and its first token."""
    for rid, p in prompts.items():
        engine.add_request(rid, p, P, prefill_only=True)
    first = {}
    while engine.has_unfinished():
        for out in engine.step():
            first[out.request_id] = out.new_token_ids[0]
    kv = {
        rid: [tuple(t.clone() for t in export_kv(engine, rid, layer)) for layer in range(LAYERS)]
        for rid in prompts
    }
    for rid in prompts:
        engine.release(rid)
    return kv, first


def _import_and_decode(engine, prompts, kv, first):
    for rid, p in prompts.items():
        assert engine.reserve_for_import(rid, p, P)
        for layer, (k, v) in enumerate(kv[rid]):
            engine.import_kv_layer(rid, layer, k, v)
        engine.commit_import(rid, first[rid])
    got = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    return got


def test_import_into_mixed_matches_monolithic(make_engine):
    """auto prefill -> mixed int4 decode: the decode side quantizes exactly as if it had prefilled itself."""
    kw = dict(block_size=8, kv_cache_dtype="int4", full_precision_layers=(0, 1))
    expected = dict(zip(PROMPTS, make_engine(**kw).generate(list(PROMPTS.values()), P), strict=True))
    kv, first = _prefill(make_engine(block_size=16), PROMPTS)
    assert _import_and_decode(make_engine(**kw), PROMPTS, kv, first) == expected


def test_export_from_mixed(make_engine):
    """mixed int4 prefill -> export: full-precision layers are bit-exact, quantized ones dequantized."""
    kv_ref, first_ref = _prefill(make_engine(block_size=16), PROMPTS)
    kv, first = _prefill(
        make_engine(block_size=16, kv_cache_dtype="int4", full_precision_layers=(0, 2)), PROMPTS
    )
    assert first == first_ref  # the prefill itself attends to fresh, unquantized K/V
    for rid in PROMPTS:
        for layer in (0, 2):
            assert all(torch.equal(a, b) for a, b in zip(kv[rid][layer], kv_ref[rid][layer], strict=True))
        for a, b in zip(kv[rid][1], kv_ref[rid][1], strict=True):
            assert a.dtype == torch.float32 and not torch.equal(a, b)
            # symmetric int4: error at most half a step, step = absmax / 7 per vector
            assert ((a - b).abs() <= b.abs().amax(-1, keepdim=True) / 14 + 1e-6).all()
    # into an auto decode engine and into one with the same mixed layout: both decode to the end
    mixed_kw = dict(block_size=32, kv_cache_dtype="int4", full_precision_layers=(0, 2))
    expected = dict(zip(PROMPTS, make_engine(**mixed_kw).generate(list(PROMPTS.values()), P), strict=True))
    # re-quantizing dequantized int4 gives back the same codes, so the mixed round trip is lossless
    assert _import_and_decode(make_engine(**mixed_kw), PROMPTS, kv, first) == expected
    got = _import_and_decode(make_engine(block_size=32), PROMPTS, kv, first)
    assert all(len(t) == P.max_tokens for t in got.values())
