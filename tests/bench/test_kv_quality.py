"""KV-quantization quality tooling: the pure helpers, the fake-quant attention, and (slow) the check that
it reproduces the engine's int8/int4 decode logits."""

import pytest

from benchmarks import kv_quality as kq

torch = pytest.importorskip("torch", reason="KV quantization quality needs the worker extra (torch)")


def test_kv_bytes_and_relative_memory():
    assert kq.kv_bytes_per_vector(128, None) == 256
    assert kq.kv_bytes_per_vector(128, 8) == 128 + 4
    assert kq.kv_bytes_per_vector(128, 4) == 64 + 4
    assert kq.relative_kv_memory([None, None], 128) == 1.0
    assert kq.relative_kv_memory([4, None], 128) == pytest.approx((68 + 256) / 512)


def test_rank_and_recovered_fraction():
    assert kq.rank_layers(10.0, [10.5, 13.0, 10.1, 11.0]) == [1, 3, 0, 2]
    assert kq.recovered_fraction(10.0, 14.0, 11.0) == pytest.approx(0.75)
    assert kq.recovered_fraction(10.0, 10.0, 10.0) is None


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from pdcluster.worker.local.demo_model import build_demo_model

    d = build_demo_model(tmp_path_factory.mktemp("kvq") / "m", hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, tokenizer_vocab_size=300)
    import sysconfig
    from pathlib import Path

    src = Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"
    (d / "heldout.txt").write_text(src.read_text())
    return d


def test_no_quantization_is_exactly_the_plain_model(tiny_model):
    from transformers import LlamaForCausalLM

    plain = LlamaForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    ours = kq.load_model(tiny_model)
    x = torch.tensor([kq.eval_windows(tiny_model, None, 48, 1)[0]])
    with torch.inference_mode():
        kq.set_layer_bits(ours, [None, None], prefill_len=16)
        a, b = plain(input_ids=x).logits, ours(input_ids=x).logits
        assert torch.allclose(a, b, atol=1e-5)
        kq.set_layer_bits(ours, [4, 4], prefill_len=16)
        c = ours(input_ids=x).logits
    # prompt rows (prefill, fresh K/V) are untouched; continuation rows see the quantized cache
    assert torch.allclose(a[:, :16], c[:, :16], atol=1e-5)
    assert not torch.allclose(a[:, 16:], c[:, 16:], atol=1e-4)
    with pytest.raises(ValueError):
        kq.set_layer_bits(ours, [4])


def test_measure_reports_tables(tiny_model):
    r = kq.measure(tiny_model, seq_len=32, n_windows=4, log=lambda m: None)
    assert r["layers"] == 2 and r["prefill_len"] == 16 and r["eval_tokens"] == 4 * 15
    p = r["perplexity"]
    assert abs(p["int8"] - p["fp32"]) <= abs(p["int4"] - p["fp32"]) + 1e-6
    assert sorted(r["sensitivity_order"]) == [0, 1]
    assert [len(m["full_precision_layers"]) for m in r["keep_most_sensitive"]] == [0, 1, 2]
    assert 0 <= r["kl"]["int8"] < r["kl"]["int4"]
    assert r["keep_most_sensitive"][-1]["kl"] == pytest.approx(0, abs=1e-9)
    assert r["keep_most_sensitive"][-1]["perplexity"] == pytest.approx(p["fp32"], rel=1e-6)
    md = kq.markdown(r)
    assert "| int8, all layers |" in md and "control" in md


@pytest.mark.slow
def test_reimplementation_matches_the_engine(tiny_model):
    for bits in (8, 4):
        c = kq.check_engine(tiny_model, bits, prompt_len=24, new_tokens=6)
        # exact up to float noise, while a non-quantized reference is visibly off
        assert c["max_abs_diff"] < 1e-4, c
        assert c["max_abs_diff_vs_unquantized"] > 10 * c["max_abs_diff"], c
