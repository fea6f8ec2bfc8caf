"""KV-transfer benchmarks: throughput vs raw TCP in the same run, fp32/fp16 vs int8, and layer-wise overlap.

    python -m benchmarks.disagg_transfer [--layers 32 --tokens 2048 --kv-heads 8 --head-dim 128]
        [--overlap-model-layers 8] [--json OUT]

1. Paths side by side, per layer size (default 1, 16, 64, 256 MiB; `benchmarks/transfer_pair.py`): one request
   of L such layers (32 down to 2) streamed into another process's cache, timed until the sender holds the
   final acknowledgement — raw loopback TCP (sendall / recv_into straight into the cache, one reply), the TCP
   backend and the NIXL backend (the real connectors: handshake, GMAC, ACKs) with fp32, int8 compression and
   an int8 cache's codes; plus a NIXL/UCX agent WRITE into another process (`benchmarks/transfer_paths.py`).
   Goals (issue 12): TCP backend >= 70 % of raw TCP, NIXL >= raw TCP.
2. KV transfer: a synthetic model's whole KV (`layers` x [tokens, kv_heads, head_dim] for K and V) through
   the real connector, in fp32, fp16 and int8 on the wire.
   "effective" throughput counts the fp16 bytes the KV would occupy in a typical cache, so int8 shows what
   compression buys; "wire" counts bytes actually sent.
3. Overlap: a real engine prefills a long prompt with the layer hook shipping each layer as it is written;
   tail = time from the end of prefill to the last ACK, whole = first frame to last ACK. Also measured with
   the hook disabled and the KV sent after prefill (what pipelining saves). TCP and NIXL backends.
4. End to end (`benchmarks/disagg_ttft.py`): TTFT, second token and whole request of a 2,048-token prompt through
   `pdcluster up` (router -> prefill -> transfer -> decode), per backend.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import transfer_pair, transfer_paths
from pdcluster.worker.transfer.connector import LoadSpec, TCPConnector, TransferTarget
from pdcluster.worker.transfer.options import TransferOptions

SECRET = b"bench-secret-0123456789abcdef"


async def raw_tcp(total_bytes: int, chunk: int = 1 << 20) -> float:
    """GB/s of plain asyncio TCP over loopback."""
    done = asyncio.Event()
    got = 0

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal got
        while True:
            data = await reader.read(1 << 20)
            if not data:
                break
            got += len(data)
        done.set()
        writer.close()

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    buf = b"\0" * chunk
    _, w = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.perf_counter()
    sent = 0
    while sent < total_bytes:
        w.write(buf)
        await w.drain()
        sent += chunk
    w.close()
    await done.wait()
    dt = time.perf_counter() - t0
    server.close()
    return got / dt / 1e9


async def kv_transfer(layers: int, tokens: int, heads: int, dim: int, compression: str,
                      dtype: torch.dtype) -> dict[str, Any]:
    recv = TCPConnector(SECRET, TransferOptions(), importer=transfer_paths._Cache())
    port = await recv.listen()
    send = TCPConnector(SECRET, TransferOptions(compression=compression))
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(tokens, heads, dim, generator=g).to(dtype), torch.randn(tokens, heads, dim, generator=g).to(dtype))
          for _ in range(layers)]
    best: dict[str, Any] | None = None
    for rep in range(3):
        rid = f"bench-{compression}-{dtype}-{rep}"
        recv.start_load_kv(LoadSpec(rid, layers, tokens, heads, dim))
        send.start_save(rid, TransferTarget("127.0.0.1", port), layers)
        t0 = time.perf_counter()
        for i, (k, v) in enumerate(kv):
            send.save_kv_layer(rid, i, k, v)
        res = await send.wait_for_save(rid)
        await recv.wait_for_load(rid, timeout=60)
        dt = time.perf_counter() - t0
        recv.finish_load(rid)
        fp16_bytes = 2 * layers * tokens * heads * dim * 2
        row = {"compression": compression, "dtype": str(dtype).replace("torch.", ""), "seconds": dt,
               "wire_bytes": res.bytes, "wire_GBps": res.bytes / dt / 1e9,
               "effective_fp16_GBps": fp16_bytes / dt / 1e9}
        if best is None or dt < best["seconds"]:
            best = row
    await send.close()
    await recv.close()
    assert best is not None
    return best


async def overlap(model: Path, prompt_len: int, layerwise: bool, backend: str = "tcp") -> dict[str, Any] | None:
    """Prefill on a real engine (in a thread) with KV leaving per layer (or all after prefill), through the
    TCP or the NIXL backend."""
    from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine
    from pdcluster.worker.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=512, max_batch_tokens=prompt_len, num_threads=1))
    mc = engine.model_config
    if backend == "nixl" and not _nixl_ok():
        return None
    layer_bytes = 2 * prompt_len * mc.num_kv_heads * mc.head_dim * 4
    recv = transfer_paths._connector(backend, mc.num_layers * layer_bytes, importer=transfer_paths._Cache())
    port = await recv.listen()
    send = transfer_paths._connector(backend, mc.num_layers * layer_bytes)
    # max_tokens=2: with 1 the first token would finish the request and free its KV (nothing to send)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = [(i * 31) % 900 + 3 for i in range(prompt_len)]
    rows = []
    for rep in range(4):  # the first is a warm-up
        rid = f"ov-{layerwise}-{rep}"
        recv.start_load_kv(LoadSpec(rid, mc.num_layers, prompt_len, mc.num_kv_heads, mc.head_dim))
        send.start_save(rid, TransferTarget("127.0.0.1", port), mc.num_layers)
        engine.set_kv_connector(send if layerwise else None)  # the engine ships each layer as it is written
        engine.add_request(rid, prompt, params, prefill_only=True)
        t0 = time.perf_counter()
        await asyncio.to_thread(engine.step)  # one prefill step (prompt fits the token budget)
        t_prefill = time.perf_counter()
        if not layerwise:
            engine.set_kv_connector(send)  # export_kv_range gathers into what the connector lends
            for layer in range(mc.num_layers):
                k, v, scales = engine.export_kv_range(rid, layer, 0, prompt_len)
                send.save_kv_layer(rid, layer, k, v, **({"scales": scales} if scales else {}))
        res = await send.wait_for_save(rid)
        t_done = time.perf_counter()
        engine.release(rid)
        recv.finish_load(rid)
        rows.append({"prefill_s": t_prefill - t0, "transfer_s": res.seconds, "tail_s": t_done - t_prefill,
                     "bytes": res.bytes})
    await send.close()
    await recv.close()
    med = sorted(rows[1:], key=lambda r: r["tail_s"])[len(rows[1:]) // 2]
    return {"backend": backend, "layerwise": layerwise, "prompt_tokens": prompt_len, "layers": mc.num_layers, **med,
            "tail_over_transfer": med["tail_s"] / med["transfer_s"] if med["transfer_s"] else None}


def _nixl_ok() -> bool:
    from pdcluster.worker.transfer.nixl_agent import availability

    return availability().ok


def _overlaps(prompt: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        from pdcluster.worker.local.demo_model import build_demo_model

        model = build_demo_model(Path(tmp) / "m", num_hidden_layers=8, hidden_size=512, intermediate_size=1024,
                                 num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096,
                                 tokenizer=False, vocab_size=1024)
        return [r for b in ("tcp", "nixl") for lw in (True, False)
                if (r := asyncio.run(overlap(model, prompt, lw, b))) is not None]


def paths_row(nbytes: int, reps: int, fabric: bool = False) -> dict[str, Any]:
    """One layer size through every path, a request of L layers each (transfer_pair.py): sender here, each
    backend's receiver in a child process, repeats interleaved, medians; NIXL WRITE: best of reps. `fabric`:
    each backend also with --kv-transfer-integrity fabric (columns "..._fabric")."""
    nixl = transfer_pair.NIXL if _nixl_ok() else None
    mods = [transfer_pair.MODULE] + ([nixl] if nixl else [])
    if fabric:
        mods += [m + transfer_pair.FABRIC for m in mods]
    pair = transfer_pair.side_by_side(nbytes, reps, mods)
    row: dict[str, Any] = {"mib": nbytes >> 20, "layers": pair["layers"], "raw": pair["raw"], "runs": pair["runs"]}
    for name in ("fp32", "int8", "codes"):
        row[f"tcp_{name}"] = pair[name]
        row[f"nixl_{name}"] = pair.get(f"{name}@{nixl}")
        if fabric:
            row[f"tcp_{name}_fabric"] = pair.get(f"{name}@{transfer_pair.MODULE}{transfer_pair.FABRIC}")
            row[f"nixl_{name}_fabric"] = pair.get(f"{name}@{nixl}{transfer_pair.FABRIC}")
    row["nixl"] = transfer_paths.nixl_write(nbytes, reps)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--overlap-prompt", type=int, default=1024)
    p.add_argument("--sizes-mib", default="1,16,64,256", help="message sizes for the side-by-side table")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--ttft-requests", type=int, default=5,
                   help="4. end-to-end 2,048-token TTFT per backend through `pdcluster up` (0: skip)")
    p.add_argument("--paths-only", action="store_true", help="only 1. (the side-by-side table)")
    p.add_argument("--fabric", action="store_true",
                   help="1. also runs each backend with --kv-transfer-integrity fabric (more columns, twice the time)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    out: dict[str, Any] = {"shape": vars(a)}
    total = 2 * a.layers * a.tokens * a.kv_heads * a.head_dim * 4
    out["paths"] = [paths_row(int(m) << 20, a.reps, a.fabric) for m in a.sizes_mib.split(",") if m]
    out["kv"], out["overlap"] = [], []
    if not a.paths_only:
        out["raw_tcp_GBps"] = asyncio.run(raw_tcp(total))
        out["kv"] = [asyncio.run(kv_transfer(a.layers, a.tokens, a.kv_heads, a.head_dim, c, dt))
                     for c, dt in (("none", torch.float32), ("none", torch.float16), ("int8", torch.float32))]
    if not a.paths_only:
        out["overlap"] = _overlaps(a.overlap_prompt)
    cols = [("tcp_fp32", "TCP fp32"), ("tcp_int8", "TCP int8"), ("tcp_codes", "TCP codes"),
            ("nixl_fp32", "NIXL fp32"), ("nixl_int8", "NIXL int8"), ("nixl_codes", "NIXL codes")]
    if a.fabric:
        cols += [(f"{c}_fabric", f"{h} fab") for c, h in cols]
    print(f"GB/s of fp32 KV (int8: the fp32 bytes it stands for), a request of L layers of each size streamed; "
          f"median of {a.reps} interleaved, receivers in other processes; backends as % of raw TCP;"
          " codes = an int8 cache's codes + scales as they are")
    print("layer     raw TCP  " + "".join(f"{h:>15}" for _, h in cols) + "   NIXL WRITE")

    def cell(x: float | None, raw: float) -> str:
        return f"{x:>7.2f} ({x / raw:>4.0%})" if x is not None else f"{'n/a':>15}"

    for r in out["paths"]:
        nixl = f"{r['nixl']:.2f}" if r["nixl"] is not None else "n/a"
        print(f"{r['mib']:>4} MiB  {r['raw']:>7.2f}  " + "".join(f"{cell(r[c], r['raw']):>15}" for c, _ in cols)
              + f"   {nixl:>8}")
    if "raw_tcp_GBps" in out:
        print(f"raw TCP loopback (asyncio streams): {out['raw_tcp_GBps']:.2f} GB/s")
    for r in out["kv"]:
        print(f"KV {r['dtype']:>8} {r['compression']:>4}: wire {r['wire_GBps']:.2f} GB/s, "
              f"effective (fp16-equivalent) {r['effective_fp16_GBps']:.2f} GB/s, {r['seconds'] * 1000:.0f} ms")
    for r in out["overlap"]:
        print(f"overlap {r['backend']} layerwise={r['layerwise']}: prefill {r['prefill_s'] * 1000:.1f} ms, transfer "
              f"{r['transfer_s'] * 1000:.1f} ms, tail after prefill {r['tail_s'] * 1000:.1f} ms "
              f"(tail/transfer {r['tail_over_transfer']:.2f})")
    if a.ttft_requests and not a.paths_only:
        from benchmarks import disagg_ttft

        disagg_ttft.main(["--requests", str(a.ttft_requests)] + (["--json", a.json + ".ttft.json"] if a.json else []))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
