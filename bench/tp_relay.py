"""Cost of relaying KV through rank 0 (`worker/engine/parallel/kv_relay.py`) next to a TP 1 engine's export
and import of the same KV.

`python -m pdcluster.bench.tp_relay [--tokens 512] [--rounds 5]`: a small random Llama (8 layers, 4 KV heads
of 64), a TP 1 and a TP 2 engine side by side (1 thread per rank). Each round, in turn on each engine:
prefill one ``tokens``-token prompt as prefill-only with a connector that drops what it gets, timing every
``export_kv_range`` call (per layer: TP 1 gathers its cache into a host buffer; TP 2 also ``gather``s the
follower's heads to rank 0 over gloo and lays them out); then import that whole KV into a reservation,
timing every ``import_kv_layer`` (TP 2: a metadata broadcast and a ``scatter`` of the follower's heads).
Reports median ms per layer and the bytes per layer each follower moves over gloo.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pdcluster.worker.engine.kv_connector import KVConnectorBase

MODEL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=8192, max_position_embeddings=2048, tokenizer=False)


class Keep(KVConnectorBase):
    def __init__(self) -> None:
        self.layers: dict[int, Any] = {}

    def save_kv_layer(self, request_id: str, layer: int, k: Any, v: Any, token_start: int = 0,
                      scales: Any = None) -> None:
        self.layers[layer] = (k.clone(), v.clone())


def _round(engine: Any, tokens: int, i: int) -> tuple[list[float], list[float]]:
    from pdcluster.worker.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = [(31 * i + 7 * j) % 8000 + 1 for j in range(tokens)]
    keep, export_ms, import_ms = Keep(), [], []
    engine.set_kv_connector(keep)
    plain = engine.export_kv_range

    def timed(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return plain(*a, **kw)
        finally:
            export_ms.append((time.perf_counter() - t0) * 1e3)

    engine.export_kv_range = timed
    try:
        engine.add_request(f"x{i}", prompt, params, prefill_only=True)
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.export_kv_range = plain
    engine.release(f"x{i}")
    assert engine.reserve_for_import(f"m{i}", prompt, params)
    for layer, (k, v) in sorted(keep.layers.items()):
        t0 = time.perf_counter()
        engine.import_kv_layer(f"m{i}", layer, k, v, token_start=0)
        import_ms.append((time.perf_counter() - t0) * 1e3)
    engine.cancel_import(f"m{i}")
    return export_ms, import_ms


def run(tokens: int, rounds: int) -> dict[str, Any]:
    from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine
    from pdcluster.worker.local.demo_model import build_demo_model

    folder = build_demo_model(Path(tempfile.mkdtemp(prefix="tp-relay-")), **MODEL)
    engines = {tp: LLMEngine(EngineConfig(model=str(folder), tensor_parallel_size=tp, num_threads=1,
                                          num_kv_blocks=tokens // 16 + 8, max_batch_tokens=tokens))
               for tp in (1, 2)}
    got: dict[int, tuple[list[float], list[float]]] = {1: ([], []), 2: ([], [])}
    try:
        for r in range(rounds + 1):  # round 0 warms up
            for tp, engine in engines.items():
                e, i = _round(engine, tokens, r)
                if r:
                    got[tp][0].extend(e)
                    got[tp][1].extend(i)
    finally:
        for engine in engines.values():
            engine.close()
    layer_bytes = 2 * tokens * 4 * 64 * 4  # K and V, 4 KV heads of 64 float32
    out: dict[str, Any] = {"tokens": tokens, "rounds": rounds, "layer_bytes": layer_bytes,
                           "gloo_bytes_per_follower_per_layer": layer_bytes // 2}
    for tp, (e, i) in got.items():
        out[f"tp{tp}"] = {"export_ms_per_layer": statistics.median(e), "import_ms_per_layer": statistics.median(i)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdcluster.bench.tp_relay", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    res = run(a.tokens, a.rounds)
    print(f"{res['tokens']} tokens, layer {res['layer_bytes'] / 2**20:.2f} MiB, follower moves "
          f"{res['gloo_bytes_per_follower_per_layer'] / 2**20:.2f} MiB/layer over gloo (TP 2)")
    for kind in ("export", "import"):
        one, two = res["tp1"][f"{kind}_ms_per_layer"], res["tp2"][f"{kind}_ms_per_layer"]
        print(f"{kind}: TP 1 {one:.2f} ms/layer, TP 2 (relayed) {two:.2f} ms/layer ({two / one:.1f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
