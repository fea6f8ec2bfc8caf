"""Raw loopback TCP and the TCP KV backend measured the same way, side by side (issue 12: backend >= 70 % of raw).

What is timed is one *request*: L layers of `nbytes` of fp32 K+V each (L = `request_layers(nbytes)`, 32 at
1-16 MiB down to 2 at 256 MiB, so a request is at most 512 MiB), streamed from the prefill side's cache to
the decode side's cache, from the first byte leaving until the sender holds the acknowledgement that the
receiver has all of it. That is how KV moves in a worker (layer by layer, every layer of the request in
flight, no wait per layer), and both paths pay the same fixed per-request cost: one final acknowledgement
round trip.

Both paths run across the same two processes: this one sends, a spawned child receives (a worker's prefill
and decode sides are separate processes too). Repeats are interleaved — one raw request, then one request per
backend case, then the next round — after a warm-up round, and each cell is the median, so a load spike hits
every cell alike.

- raw: the L layers sent with `sendall` straight from the source cache's memory (one layer per call), received
  with `recv_into` straight into the destination cache's layer, one 1-byte reply once the last layer is in
  (the ceiling for any TCP transport on this machine: no framing, no authentication, no copy);
- backend: the real connector (handshake once, GMAC tags, ACK per frame). A thread standing in for the
  engine exports each layer as the engine does — hands the connector the cache's own bytes when it takes them
  (`save_kv_views`: float layers of a last prefill chunk, views.py), else gathers K and V into the buffer the
  connector lends (`export_buffer`, else a fresh one) and calls `save_kv_layer` — while the event loop sends; the clock stops
  when `wait_for_save` returns, i.e. when the receiver's importer has written the last layer into its cache
  and that ACK is back (a transport with `destination`, placing.py, receives float layers straight into the
  cache instead). Receiver caches: fp32 for the fp32 case, fp32 for int8 compression (the importer
  dequantizes, as a float cache must), int8 codes + scales for the codes case (stored as they are). GB/s of
  the fp32 KV the request stands for (int8 and codes: a quarter of the bytes on the wire).

`modules` names the connectors both sides use (the TCP backend, the NIXL backend, each optionally with
`--kv-transfer-integrity fabric`); each gets its own receiver process.
"""

from __future__ import annotations

import asyncio
import importlib
import multiprocessing as mp
import socket
import statistics
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from pdcluster.worker.transfer.options import TransferOptions

SECRET = b"bench-secret-0123456789abcdef"
HEADS, DIM = 8, 128
MODULE = "pdcluster.worker.transfer.connector"
NIXL = "pdcluster.worker.transfer.nixl_connector:NixlConnector"  # the NIXL backend, as a further "module"
FABRIC = "+fabric"  # a module suffix: --kv-transfer-integrity fabric (no MAC over KV bytes on either side)
CASES = (("fp32", "none", False), ("int8", "int8", False), ("codes", "none", True))
REQUEST_BYTES = 512 << 20  # cap on one request's fp32 KV (memory: the sender's cache + the receiver's)
RAW_HEAD = struct.Struct(">QQ")  # raw request: layers, bytes per layer


def connector(module: str, nbytes: int, **kw: Any) -> tuple[Any, Any]:
    """(an instance of the connector `module` names — "pkg.mod" for its TCPConnector, "pkg.mod:Class" for
    another — and the module that defines LoadSpec/TransferTarget). NIXL gets staging for a whole request."""
    name, _, cls = module.split("+")[0].partition(":")
    if cls == "NixlConnector":
        kw["staging_bytes"] = request_layers(nbytes) * (nbytes + (1 << 20))
    if FABRIC in module:
        kw["integrity"] = "fabric"
    knobs = {k: kw.pop(k) for k in ("compression", "integrity") if k in kw}  # the rest: constructor keywords
    conn = getattr(importlib.import_module(name), cls or "TCPConnector")(SECRET, TransferOptions(**knobs), **kw)
    return conn, importlib.import_module(name.rsplit(".", 1)[0] + ".connector")


def register(conn: Any, module: str, caches: list[torch.Tensor]) -> None:
    """Register the side's float cache with a connector that takes it (NIXL: cache to cache), as the worker
    registers its engine's pools."""
    reg = getattr(conn, "register_cache", None)
    if reg is not None:
        reg(caches)


def request_layers(nbytes: int) -> int:
    """Layers of one timed request: as many as fit REQUEST_BYTES, between 2 and 32 (a typical model's count)."""
    return max(2, min(32, REQUEST_BYTES // max(1, nbytes)))


def tokens_of(nbytes: int) -> int:
    return max(1, nbytes // (2 * HEADS * DIM * 4))


class LayerCache:
    """The decode side's cache for the harness: `layers` layers of K and V `[tokens, heads, dim]`, fp32, or int8
    codes with float32 scales. The importer writes each received token range into its layer once (float from
    float: a copy; codes into a float cache: dequantized straight into it; codes into a codes cache: copied)."""

    def __init__(self, layers: int, tokens: int, codes: bool) -> None:
        dt = torch.int8 if codes else torch.float32
        self.kv = torch.empty(layers, 2, tokens, HEADS, DIM, dtype=dt)
        self.scales = torch.empty(layers, 2, tokens, HEADS) if codes else None

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, token_start: int,
              scales: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        n = k.shape[0]
        for i, x in enumerate((k, v)):
            dst = self.kv[layer, i, token_start:token_start + n]
            if self.scales is not None:
                assert scales is not None
                dst.copy_(x)
                self.scales[layer, i, token_start:token_start + n].copy_(scales[i])
            elif scales is not None:  # int8 on the wire, float cache: one dequantizing pass into the cache
                torch.mul(x, scales[i].unsqueeze(-1), out=dst)
            else:
                dst.copy_(x)


def _nothing() -> None:
    pass


def raw_requests(conn: socket.socket) -> Iterator[tuple[int, int]]:
    """(layers, bytes per layer) of each raw request announced on `conn`, until the peer closes."""
    while len(head := conn.recv(RAW_HEAD.size, socket.MSG_WAITALL)) == RAW_HEAD.size:
        yield RAW_HEAD.unpack(head)


def raw_sink(srv: socket.socket, caches: dict[bool, LayerCache]) -> None:
    """Child thread: each raw request announces (layers, bytes per layer); each layer is received whole straight
    into that layer of the fp32 cache; one byte back when the request is in."""
    conn, _ = srv.accept()
    dst = caches[False].kv.view(torch.uint8).numpy()
    for layers, n in raw_requests(conn):
        for layer in range(layers):
            view, got = memoryview(dst[layer]).cast("B")[:n], 0
            while got < n:
                k = conn.recv_into(view[got:])
                if k == 0:
                    return
                got += k
        conn.sendall(b"k")
    conn.close()


async def _receiver_main(pipe: Any, module: str, nbytes: int) -> None:
    torch.set_num_threads(1)
    layers, tokens = request_layers(nbytes), tokens_of(nbytes)
    caches = {False: LayerCache(layers, tokens, False), True: LayerCache(layers, tokens, True)}
    for c in caches.values():  # first touch here, not in a timed round
        c.kv.view(torch.uint8).fill_(0)
    srv = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=raw_sink, args=(srv, caches), daemon=True).start()
    kind: dict[str, bool] = {}  # request id -> whether its cache holds codes
    # numpy views made once, as the raw sink's: torch indexing + .numpy() per call cost 6.4 vs 0.8 us a layer here,
    # the harness's, not the transport's (the engine's own views are timed in its benchmarks)
    float_kv = caches[False].kv.numpy()

    def importer(rid: str, layer: int, k: torch.Tensor, v: torch.Tensor, *, token_start: int = 0,
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        caches[kind[rid]].write(layer, k, v, token_start, scales)

    def destination(rid: str, layer: int, token_start: int, n: int, dtype: torch.dtype) -> Any:
        """Float K and V of the float cache, received in place (placing.py): no import copy."""
        if kind[rid] or dtype != torch.float32:
            return None
        kv = float_kv[layer, :, token_start:token_start + n]
        return [memoryview(kv[0]).cast("B"), memoryview(kv[1]).cast("B")], _nothing

    try:
        recv, mod = connector(module, nbytes, importer=importer, destination=destination)
    except TypeError:  # a transport from before placing.py
        recv, mod = connector(module, nbytes, importer=importer)
    register(recv, module, [caches[False].kv])
    port = await recv.listen()
    pipe.send((srv.getsockname()[1], port))
    pending: set[asyncio.Task[None]] = set()

    async def finish(rid: str) -> None:
        await recv.wait_for_load(rid, timeout=300)
        recv.finish_load(rid)
        kind.pop(rid, None)

    while True:
        msg = await asyncio.to_thread(pipe.recv)
        if msg is None:
            break
        rid, codes = msg
        kind[rid] = codes
        recv.start_load_kv(mod.LoadSpec(rid, layers, tokens, HEADS, DIM))
        t = asyncio.ensure_future(finish(rid))
        pending.add(t)
        t.add_done_callback(pending.discard)
        pipe.send("ready")
    await recv.close()
    srv.close()


def _receiver(pipe: Any, module: str, nbytes: int) -> None:
    asyncio.run(_receiver_main(pipe, module, nbytes))


def raw_once(sock: socket.socket, layers: list[memoryview]) -> float:
    t0 = time.perf_counter()
    sock.sendall(RAW_HEAD.pack(len(layers), len(layers[0])))
    for data in layers:
        sock.sendall(data)
    if sock.recv(1) != b"k":
        raise RuntimeError("raw sink closed")
    return time.perf_counter() - t0


def _export_all(send: Any, rid: str, src: torch.Tensor, src_scales: torch.Tensor | None) -> None:
    """The engine's side of a request, on its own thread: per layer, gather K and V into what the connector
    lends (else a fresh buffer, as the engine allocates) and hand it to `save_kv_layer`; or, as the engine does
    for a float layer of its last prefill chunk when the connector takes them (`save_kv_views`, views.py), hand
    it the cache's own bytes (K's, then V's), no gather."""
    views = getattr(send, "save_kv_views", None) if src_scales is None else None
    src_np = src.numpy()  # views made from numpy, as raw's: torch indexing per layer is the harness's cost
    for layer in range(src.shape[0]):
        kv_src = src[layer]
        parts = [memoryview(src_np[layer, i]).cast("B") for i in range(2)]
        if views is not None and views(rid, layer, parts, token_start=0, num_tokens=kv_src.shape[1],
                                       kv_heads=kv_src.shape[2], head_dim=kv_src.shape[3], dtype=kv_src.dtype):
            continue
        size = kv_src.numel() * kv_src.element_size()
        scale_size = src_scales[layer].numel() * 4 if src_scales is not None else 0
        buf = send.export_buffer(rid, layer, 0, size + scale_size, quantized=src_scales is not None)
        if buf is None:
            buf = torch.empty(size + scale_size, dtype=torch.uint8)
        kv = buf[:size].view(kv_src.dtype).view(kv_src.shape)
        kv.copy_(kv_src)  # the engine's gather out of its paged cache
        kw: dict[str, Any] = {}
        if src_scales is not None:
            sc = buf[size:].view(torch.float32).view(src_scales[layer].shape)
            sc.copy_(src_scales[layer])
            kw["scales"] = (sc[0], sc[1])
        send.save_kv_layer(rid, layer, kv[0], kv[1], **kw)


async def _backend_once(send: Any, pipe: Any, port: int, module: Any, rid: str, src: torch.Tensor,
                        src_scales: torch.Tensor | None) -> float:
    pipe.send((rid, src_scales is not None))
    if await asyncio.to_thread(pipe.recv) != "ready":
        raise RuntimeError("receiver not ready")
    send.start_save(rid, module.TransferTarget("127.0.0.1", port), src.shape[0])
    t0 = time.perf_counter()
    await asyncio.to_thread(_export_all, send, rid, src, src_scales)
    await send.wait_for_save(rid)
    return time.perf_counter() - t0


async def _sender(nbytes: int, reps: int, modules: list[str], pipes: list[Any], ports: list[tuple[int, int]],
                  cases: tuple[tuple[str, str, bool], ...]) -> dict[str, list[float]]:
    from pdcluster.kernels.kv_quant import quantize_kv

    # one torch thread, as in the receiver: idle OpenMP workers spin after each copy, and on this 2-core box
    # that spinning took the cores the sockets need (sender CPU per 1 MiB x 32 request: 91 ms with the
    # default threads, 27 ms with one; raw TCP 9-10 ms)
    torch.set_num_threads(1)
    layers, tokens = request_layers(nbytes), tokens_of(nbytes)
    fp32 = layers * 2 * tokens * HEADS * DIM * 4
    src = torch.randn(layers, 2, tokens, HEADS, DIM, generator=torch.Generator().manual_seed(0))
    q, s = quantize_kv(src, bits=8) if any(c for _, _, c in cases) else (None, None)
    raw_layers = [memoryview(src[i].numpy()).cast("B") for i in range(layers)]  # type: ignore[arg-type]
    raws = [socket.create_connection(("127.0.0.1", p[0])) for p in ports]
    senders, mods = {}, []
    for i, m in enumerate(modules):
        for name, comp, _ in cases:
            senders[(i, name)], mod = connector(m, nbytes, compression=comp)
            register(senders[(i, name)], m, [src])
        mods.append(mod)
    times: dict[str, list[float]] = {}
    for rnd in range(reps + 1):  # round 0 warms up (connections, first-touch of every buffer)
        for i, m in enumerate(modules):
            tag = "" if i == 0 else f"@{m}"
            dt = raw_once(raws[i], raw_layers)
            if rnd:
                times.setdefault("raw" + tag, []).append(fp32 / dt)
            for name, _, codes in cases:
                kv, sc = (q, s) if codes else (src, None)
                assert kv is not None
                dt = await _backend_once(senders[(i, name)], pipes[i], ports[i][1], mods[i], f"{name}-{rnd}", kv, sc)
                if rnd:
                    times.setdefault(name + tag, []).append(fp32 / dt)
    for c in senders.values():
        await c.close()
    for r in raws:
        r.close()
    return times


def side_by_side(nbytes: int, reps: int = 5, modules: list[str] | None = None,
                 cases: tuple[tuple[str, str, bool], ...] = CASES) -> dict[str, Any]:
    """Median GB/s per cell ("raw", "fp32", "int8", "codes"; cells of a further module get "@module"), with
    every repeat kept under "runs" and the request's shape under "layers"."""
    modules = modules or [MODULE]
    ctx = mp.get_context("spawn")
    procs, pipes, ports = [], [], []
    for m in modules:
        here, there = ctx.Pipe()
        p = ctx.Process(target=_receiver, args=(there, m, nbytes), daemon=True)
        p.start()
        procs.append(p)
        pipes.append(here)
        if not here.poll(120):  # the child died importing, or is stuck: fail rather than hang
            p.kill()
            raise RuntimeError(f"receiver process for {m} did not start (exit code {p.exitcode})")
        ports.append(here.recv())
    try:
        runs = asyncio.run(_sender(nbytes, reps, modules, pipes, ports, cases))
    finally:
        for pipe in pipes:
            pipe.send(None)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return {"mib": nbytes >> 20, "layers": request_layers(nbytes),
            **{k: statistics.median(v) / 1e9 for k, v in runs.items()},
            "runs": {k: [x / 1e9 for x in v] for k, v in runs.items()}}
