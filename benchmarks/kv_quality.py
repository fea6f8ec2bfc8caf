"""KV-cache quantization quality, measured: perplexity with fp32 vs int8 vs int4 K/V, per-layer
sensitivity, and how much of the int4 loss keeping the most sensitive layers in full precision
(`kvCache.fullPrecisionLayers`) recovers.

How K/V are perturbed: exactly as the engine's paged cache stores them. Every K and V vector (per token,
per KV head, after RoPE) goes through `pdcluster.kernels.quantize_kv` and back through `dequantize_kv`,
the same symmetric per-vector absmax scheme, and attention reads the dequantized values.

Which attention reads them matters, and mirrors serving: each evaluation window is a prompt (the first
`prefill_len` tokens) followed by a continuation. Prompt tokens attend to their fresh K/V, as our prefill
does, so their hidden states are exact; the cache still stores their K/V quantized. Continuation tokens
attend to the quantized cache (theirs and the prompt's), as decode does, so the error compounds through
layers for generated tokens only. Perplexity is scored on the continuation: the tokens a user receives.
(`--prefill-len 0` is the harsher "every token decoded" variant.) `--check-engine` verifies the
reimplementation against the real engine: greedy decode with `kv_cache_dtype=int8/int4` and
`debug_logits`, compared logit by logit.

Run: python -m benchmarks.kv_quality [--model DIR] [--out results.json]
(default model: the trained demo model, `make demo-model`; a random model cannot show quality loss).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ATTN_NAME = "pdcluster_kvq"


# ------------------------------------------------------------------------------------- pure helpers


def kv_bytes_per_vector(head_dim: int, bits: int | None, full_bytes: int = 2) -> float:
    """Bytes of one K or V vector in the cache: codes + a float32 scale (quantized), or fp16/bf16."""
    if bits is None:
        return head_dim * full_bytes
    return head_dim * bits / 8 + 4


def relative_kv_memory(layer_bits: Sequence[int | None], head_dim: int) -> float:
    """KV memory of a per-layer precision assignment relative to 16-bit everywhere."""
    full = kv_bytes_per_vector(head_dim, None)
    return sum(kv_bytes_per_vector(head_dim, b) for b in layer_bits) / (full * len(layer_bits))


def rank_layers(base_ppl: float, single_layer_ppl: Sequence[float]) -> list[int]:
    """Layers ordered most sensitive first (largest perplexity increase when only it is quantized)."""
    return sorted(range(len(single_layer_ppl)), key=lambda i: (-(single_layer_ppl[i] - base_ppl), i))


def recovered_fraction(base: float, all_quant: float, mixed: float) -> float | None:
    """Share of the quantization loss (all_quant - base) that `mixed` wins back; None if no loss."""
    loss = all_quant - base
    if loss <= 1e-12:
        return None
    return (all_quant - mixed) / loss


# --------------------------------------------------------------------------------- the measurement


def _fake_quant(x, bits: int):
    from pdcluster.kernels import dequantize_kv, quantize_kv

    q, scale = quantize_kv(x, bits=bits)
    return dequantize_kv(q, scale, bits=bits, dtype=x.dtype)


def _register_attention() -> None:
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        # key/value: [batch, kv_heads, seq, head_dim] after RoPE, before GQA expansion: one vector per
        # token and KV head, like a cache slot.
        bits = getattr(module, "pdc_kv_bits", None)
        if not bits:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        out_q, w = sdpa_attention_forward(module, query, _fake_quant(key, bits), _fake_quant(value, bits),
                                          attention_mask, **kwargs)
        p = min(getattr(module, "pdc_prefill_len", 0), query.shape[2])
        if p == 0:
            return out_q, w
        # prompt rows: prefill attends to fresh K/V (output is [batch, seq, heads, head_dim])
        out_fresh, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return torch.cat((out_fresh[:, :p], out_q[:, p:]), dim=1), w

    AttentionInterface.register(ATTN_NAME, attention)


def load_model(model_dir: str | Path):
    import torch
    from transformers import LlamaForCausalLM

    _register_attention()
    model = LlamaForCausalLM.from_pretrained(str(model_dir), attn_implementation=ATTN_NAME, dtype=torch.float32)
    model.eval()
    return model


def set_layer_bits(model, layer_bits: Sequence[int | None], prefill_len: int = 0) -> None:
    """Per-layer KV precision (None = full) and how many leading tokens of each window are prompt."""
    layers = model.model.layers
    if len(layer_bits) != len(layers):
        raise ValueError(f"{len(layer_bits)} settings for {len(layers)} layers")
    for layer, bits in zip(layers, layer_bits, strict=True):
        layer.self_attn.pdc_kv_bits = bits
        layer.self_attn.pdc_prefill_len = prefill_len


def eval_windows(model_dir: str | Path, text: str | None, seq_len: int, n_windows: int) -> list[list[int]]:
    """Non-overlapping token windows of held-out text (the demo model's heldout.txt by default)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    if text is None:
        text = (Path(model_dir) / "heldout.txt").read_text(encoding="utf-8")
    ids = tok.encode(text).ids
    wins = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)][:n_windows]
    if not wins:
        raise ValueError(f"held-out text has fewer than {seq_len} tokens")
    return wins


def score(model, windows: list[list[int]], score_from: int = 0, ref: list | None = None,
          batch: int = 16) -> tuple[float, float | None, list]:
    """(perplexity, mean KL(ref || this) per token or None, log-probs) over the tokens predicted at
    positions >= score_from (the continuation).

    Why KL too: on a small model the perplexity change of int4 K/V can be smaller than the noise of which
    tokens happen to get a little more or less likely, and can even go down. The KL divergence from the
    full-precision next-token distribution measures how much quantization changes the model's output,
    is never negative, and ranks layers reliably.
    """
    import torch

    nll, kl, count, out = 0.0, 0.0, 0, []
    with torch.inference_mode():
        for j, i in enumerate(range(0, len(windows), batch)):
            x = torch.tensor(windows[i : i + batch])
            logp = torch.log_softmax(model(input_ids=x).logits[:, score_from:-1].float(), dim=-1)
            target = x[:, score_from + 1 :]
            nll -= logp.gather(-1, target.unsqueeze(-1)).sum().item()
            count += target.numel()
            if ref is not None:
                kl += (ref[j].exp() * (ref[j] - logp)).sum().item()
            out.append(logp)
    return math.exp(nll / count), (kl / count if ref is not None else None), out


def perplexity(model, windows: list[list[int]], score_from: int = 0, batch: int = 16) -> float:
    return score(model, windows, score_from, None, batch)[0]


def measure(model_dir: str | Path, seq_len: int = 128, n_windows: int = 64, bits_low: int = 4,
            prefill_len: int | None = None, log=print) -> dict:
    model = load_model(model_dir)
    n_layers = len(model.model.layers)
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    windows = eval_windows(model_dir, None, seq_len, n_windows)
    p_len = seq_len // 2 if prefill_len is None else prefill_len
    t0 = time.time()
    set_layer_bits(model, [None] * n_layers, p_len)
    fp, _, ref = score(model, windows, p_len)

    def run(bits: Sequence[int | None]) -> dict:
        set_layer_bits(model, bits, p_len)
        ppl, kl, _ = score(model, windows, p_len, ref)
        return {"perplexity": ppl, "kl": kl, "kv_memory_vs_16bit": relative_kv_memory(bits, head_dim)}

    int8 = run([8] * n_layers)
    low = run([bits_low] * n_layers)
    log(f"fp32 {fp:.3f}  int8 {int8['perplexity']:.3f} (KL {int8['kl']:.2e})  "
        f"int{bits_low} {low['perplexity']:.3f} (KL {low['kl']:.2e})  ({time.time() - t0:.0f}s)")
    single = []
    for i in range(n_layers):
        r = run([bits_low if j == i else None for j in range(n_layers)])
        single.append({"layer": i, **r, "delta": r["perplexity"] - fp})
        log(f"  only layer {i} int{bits_low}: ppl {r['perplexity']:.3f}  KL {r['kl']:.2e}")
    order = rank_layers(0.0, [s["kl"] for s in single])  # most sensitive = largest KL

    def with_recovery(r: dict, keep: list[int]) -> dict:
        return {"full_precision_layers": keep, **r,
                "recovered_kl": recovered_fraction(0.0, low["kl"], r["kl"]),
                "recovered_ppl": recovered_fraction(fp, low["perplexity"], r["perplexity"])}

    mixed = []
    for k in range(n_layers + 1):
        keep = sorted(order[:k])
        mixed.append(with_recovery(run([None if j in keep else bits_low for j in range(n_layers)]), keep))
    # Control: keep the *least* sensitive layer instead; the ranking, not the count, should matter.
    least = order[-1]
    control = with_recovery(run([None if j == least else bits_low for j in range(n_layers)]), [least])
    return {
        "model": str(model_dir), "layers": n_layers, "head_dim": head_dim, "seq_len": seq_len,
        "prefill_len": p_len, "eval_tokens": sum(len(w) - 1 - p_len for w in windows), "bits_low": bits_low,
        "perplexity": {"fp32": fp, "int8": int8["perplexity"], f"int{bits_low}": low["perplexity"]},
        "kl": {"fp32": 0.0, "int8": int8["kl"], f"int{bits_low}": low["kl"]},
        "kv_memory_vs_16bit": {"fp32": 2.0, "fp16": 1.0, "int8": int8["kv_memory_vs_16bit"],
                               f"int{bits_low}": low["kv_memory_vs_16bit"]},
        "single_layer": single,
        "sensitivity_order": order,
        "keep_most_sensitive": mixed,
        "control_keep_least_sensitive": control,
        "seconds": time.time() - t0,
    }


# ------------------------------------------------------------------------------ engine cross-check


def check_engine(model_dir: str | Path, bits: int, prompt_len: int = 64, new_tokens: int = 32) -> dict:
    """Greedy decode on the real engine with a quantized KV cache vs this file's reimplementation.

    The engine's first token comes from prefill (fresh K/V), later ones from decode over the quantized
    cache: the reimplementation with prefill_len = prompt length must match every one of them.
    """
    import torch

    from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine
    from pdcluster.worker.engine.sampling_params import SamplingParams

    prompt = eval_windows(model_dir, None, prompt_len, 1)[0]
    eng = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_dtype=f"int{bits}",
                                 debug_logits=True, max_batch_size=1, enable_prefix_caching=False))
    eng.add_request("q", prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    tokens, logits = [], []
    while eng.has_unfinished():
        for out in eng.step():
            tokens += out.new_token_ids
            logits.append(out.extra["logits"].float())
    model = load_model(model_dir)
    n = len(model.model.layers)
    seq = torch.tensor([prompt + tokens[:-1]])
    with torch.inference_mode():
        set_layer_bits(model, [None] * n)
        ref_fp = model(input_ids=seq).logits[0].float()
        set_layer_bits(model, [bits] * n, prefill_len=prompt_len)
        ref_q = model(input_ids=seq).logits[0].float()
    diffs = [(logits[i] - ref_q[prompt_len - 1 + i]).abs().max().item() for i in range(len(logits))]
    # what "not faithful" would look like: the same decode logits against an unquantized reference
    unquant = [(logits[i] - ref_fp[prompt_len - 1 + i]).abs().max().item() for i in range(1, len(logits))]
    return {"bits": bits, "positions": len(logits), "max_abs_diff": max(diffs),
            "max_abs_diff_vs_unquantized": max(unquant) if unquant else 0.0,
            "logit_scale": ref_fp.abs().max().item()}


# ----------------------------------------------------------------------------------------- report


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x * 100:.0f}%"


def markdown(r: dict) -> str:
    low = f"int{r['bits_low']}"
    mem, p, kl = r["kv_memory_vs_16bit"], r["perplexity"], r["kl"]
    lines = [
        f"Model `{Path(r['model']).name}`: {r['layers']} layers, head_dim {r['head_dim']}; windows of "
        f"{r['seq_len']} held-out tokens, the first {r['prefill_len']} as the prompt (prefill), "
        f"{r['eval_tokens']} continuation tokens scored (decode over the quantized cache). KL = mean "
        "KL(fp32 ‖ quantized) of the next-token distribution, nats/token.",
        "",
        "| KV cache | perplexity | Δ vs fp32 | KL vs fp32 | KV memory vs 16-bit |",
        "|---|---:|---:|---:|---:|",
        f"| fp32 (reference) | {p['fp32']:.3f} | – | 0 | 2.00× |",
    ]
    for name in ("int8", low):
        lines.append(f"| {name}, all layers | {p[name]:.3f} | {(p[name] / p['fp32'] - 1) * 100:+.2f}% | "
                     f"{kl[name]:.2e} | {mem[name]:.2f}× |")
    lines += ["", f"Per-layer sensitivity (only that layer {low}, the rest full precision):", "",
              "| layer | perplexity | Δ vs fp32 | KL vs fp32 | rank |", "|---:|---:|---:|---:|---:|"]
    rank = {layer: i + 1 for i, layer in enumerate(r["sensitivity_order"])}
    for s in r["single_layer"]:
        lines.append(f"| {s['layer']} | {s['perplexity']:.3f} | {(s['perplexity'] / p['fp32'] - 1) * 100:+.2f}% | "
                     f"{s['kl']:.2e} | {rank[s['layer']]} |")
    lines += ["", f"{low} everywhere except the k most sensitive layers (`kvCache.fullPrecisionLayers`):", "",
              f"| k | full-precision layers | perplexity | KL vs fp32 | {low} KL recovered | KV memory vs 16-bit |",
              "|---:|---|---:|---:|---:|---:|"]
    rows = [(str(k), m) for k, m in enumerate(r["keep_most_sensitive"])]
    rows.append(("1 (control: least sensitive)", r["control_keep_least_sensitive"]))
    for k, m in rows:
        lines.append(f"| {k} | {m['full_precision_layers'] or '–'} | {m['perplexity']:.3f} | {m['kl']:.2e} | "
                     f"{_pct(m['recovered_kl'])} | {m['kv_memory_vs_16bit']:.2f}× |")
    return "\n".join(lines) + "\n"


def trained_demo_model() -> Path:
    """The trained demo model's folder, trained first if it is not cached (`scripts/train_demo_model.py`,
    run as a script: it lives outside the package and prints the folder last)."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "train_demo_model.py"
    proc = subprocess.run([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, check=True)
    return Path(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="KV-cache quantization quality (perplexity, per-layer sensitivity)")
    ap.add_argument("--model", default=None, help="HF Llama folder with tokenizer.json and heldout.txt "
                    "(default: the trained demo model; trains it if missing)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=None,
                    help="prompt tokens per window (default seq-len/2; 0 = every token decoded)")
    ap.add_argument("--bits", type=int, default=4, choices=[4, 8], help="the low precision to study per layer")
    ap.add_argument("--check-engine", action="store_true", help="also compare with the engine's int8/int4 decode")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here")
    a = ap.parse_args(argv)
    import torch

    torch.manual_seed(0)
    model_dir = a.model
    if model_dir is None:
        model_dir = trained_demo_model()
    r = measure(model_dir, a.seq_len, a.windows, a.bits, a.prefill_len, log=lambda m: print(m, file=sys.stderr))
    if a.check_engine:
        r["engine_check"] = [check_engine(model_dir, b) for b in (8, 4)]
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(r, indent=1))
    print(markdown(r))
    for c in r.get("engine_check", []):
        print(f"engine check int{c['bits']}: max |logit diff| {c['max_abs_diff']:.2e} over {c['positions']} "
              f"positions (vs unquantized reference: {c['max_abs_diff_vs_unquantized']:.2e}; logits up to "
              f"{c['logit_scale']:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
