"""Cost of relaying KV through rank 0 (`worker/engine/parallel/kv_relay.py`) next to the direct path (each
rank its own heads: `worker/server/tp_direct.py`) and a TP 1 engine's export and import of the same KV.

`python -m pdcluster.bench.tp_relay [--tokens 512] [--rounds 5]`: a small random Llama (8 layers, 4 KV heads
of 64), a TP 1 and a TP 2 engine side by side (1 thread per rank). Each round, in turn on each engine and path:
prefill one ``tokens``-token prompt as prefill-only with a connector that keeps what it gets, timing every
``export_kv_range`` call (per layer: TP 1 gathers its cache into a host buffer; TP 2 relayed also ``gather``s
the follower's heads to rank 0 over gloo and lays them out; TP 2 direct exports rank 0's own heads only, the
follower exporting its own in its process meanwhile: `ExportOnly`); then import that KV into a reservation,
timing every ``import_kv_layer`` (TP 2 relayed: a metadata broadcast and a ``scatter`` of the follower's
heads; direct: rank 0 writes its own heads, `head_offset`, the follower its own in its process). The wire is
not in it (bench/reshard_transfer.py times head routes per rank). Reports median ms per layer on rank 0 and
the bytes per layer the follower moves over gloo (relayed; 0 direct).
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


class ExportOnly:
    """A follower's KV endpoint without the wire (started by name, as the server starts tp_rank's): in the
    forward it exports its heads of each range into a host buffer, which is the rank's work before sending."""

    def __init__(self, *, rank: int, size: int, runner: Any, lock: Any, reply: Any, options: Any) -> None:
        self.runner = runner
        reply({"op": "kv_ready", "port": 0})

    def save(self, rid: str, targets: Any, layer: int, token_start: int, slots: Any) -> None:
        import torch

        cache = self.runner.cache
        cache.export_into(layer, slots, torch.empty(cache.export_bytes(layer, int(slots.numel())), dtype=torch.uint8))

    def command(self, msg: Any) -> None:
        pass


def start_export_only(engine: Any) -> None:
    """Give each follower of a TP engine an `ExportOnly` endpoint; back once they all said so."""
    import threading

    ready = threading.Semaphore(0)
    control = engine.runner.control
    control.listener = lambda rank, msg: ready.release() if msg.get("op") == "kv_ready" else None
    for r in control.ranks:
        control.send(r, {"op": "kv_listen", "factory": "pdcluster.bench.tp_relay:ExportOnly", "options": {}})
    for _ in control.ranks:
        if not ready.acquire(timeout=120):
            raise RuntimeError("a follower did not start its endpoint")


class Keep(KVConnectorBase):
    def __init__(self) -> None:
        self.layers: dict[int, Any] = {}

    def save_kv_layer(self, request_id: str, layer: int, k: Any, v: Any, token_start: int = 0,
                      scales: Any = None) -> None:
        self.layers[layer] = (k.clone(), v.clone())


def _round(engine: Any, tokens: int, i: int, direct: bool = False) -> tuple[list[float], list[float]]:
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
    if direct:  # what tp_direct.start_save does for a request going direct (the address is never used here)
        engine.runner.direct[f"x{i}"] = [("127.0.0.1", 1)]
    try:
        engine.add_request(f"x{i}", prompt, params, prefill_only=True)
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.export_kv_range = plain
        if direct:
            engine.runner.direct.pop(f"x{i}")
    engine.release(f"x{i}")
    assert engine.reserve_for_import(f"m{i}", prompt, params)
    for layer, (k, v) in sorted(keep.layers.items()):
        t0 = time.perf_counter()
        engine.import_kv_layer(f"m{i}", layer, k, v, token_start=0, **({"head_offset": 0} if direct else {}))
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
    start_export_only(engines[2])
    cases = {"tp1": (1, False), "tp2": (2, False), "tp2_direct": (2, True)}
    got: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in cases}
    try:
        for r in range(rounds + 1):  # round 0 warms up
            for name, (tp, direct) in cases.items():
                e, i = _round(engines[tp], tokens, 2 * r + direct, direct)
                if r:
                    got[name][0].extend(e)
                    got[name][1].extend(i)
    finally:
        for engine in engines.values():
            engine.close()
    layer_bytes = 2 * tokens * 4 * 64 * 4  # K and V, 4 KV heads of 64 float32
    out: dict[str, Any] = {"tokens": tokens, "rounds": rounds, "layer_bytes": layer_bytes,
                           "gloo_bytes_per_follower_per_layer": layer_bytes // 2}
    for name, (e, i) in got.items():
        out[name] = {"export_ms_per_layer": statistics.median(e), "import_ms_per_layer": statistics.median(i)}
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
        one, two, d = (res[n][f"{kind}_ms_per_layer"] for n in ("tp1", "tp2", "tp2_direct"))
        print(f"{kind}: TP 1 {one:.2f} ms/layer, TP 2 relayed {two:.2f} ms/layer ({two / one:.1f}x), "
              f"TP 2 direct {d:.2f} ms/layer ({d / one:.1f}x) on rank 0")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
