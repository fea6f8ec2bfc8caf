"""Raw loopback TCP and the TCP KV backend measured the same way, side by side (issue 12: backend >= 70 % of raw).

Both paths run across the same two processes: this one sends, a spawned child receives (a worker's prefill
and decode sides are separate processes too, so each side has its own interpreter and core). Repeats are
interleaved — one raw message, then one message per backend case, then the next round — after a warm-up
round, and each cell is the median, so a load spike hits every cell alike.

- raw: `sendall` of one message from a buffer allocated once, `recv_into` one buffer allocated once, a
  1-byte reply when the whole message is in (the ceiling for any TCP transport on this machine);
- backend: the real connector (handshake once, GMAC tags, ACK after import), timed like a worker moving one
  layer: the export gathers K and V into the buffer the connector lends (`export_buffer`, else a fresh one
  as the engine allocates), `save_kv_layer`, and `wait_for_save` returns once the receiver's importer has
  copied the layer into its cache and ACKed. GB/s of the fp32 KV the layer stands for (int8: a quarter of
  the bytes on the wire; codes: an int8 cache's own codes + scales, nothing quantized).

`connector_module` names the module whose `TCPConnector` both sides use: a copy of an older transport (e.g.
`git show HEAD:...` into a temporary package on PYTHONPATH) runs in the same harness for before/after.
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
from typing import Any

import torch

SECRET = b"bench-secret-0123456789abcdef"
HEADS, DIM = 8, 128
MODULE = "pdcluster.worker.transfer.connector"
CASES = (("fp32", "none", False), ("int8", "int8", False), ("codes", "none", True))
_LEN = struct.Struct(">Q")


def _raw_sink(srv: socket.socket, size: int) -> None:
    """Child thread: each message is announced by its length, received whole into one reusable buffer."""
    buf = memoryview(bytearray(size))
    conn, _ = srv.accept()
    while True:
        head = conn.recv(_LEN.size, socket.MSG_WAITALL)
        if len(head) < _LEN.size:
            break
        n, got = _LEN.unpack(head)[0], 0
        while got < n:
            k = conn.recv_into(buf[got:n])
            if k == 0:
                return
            got += k
        conn.sendall(b"k")
    conn.close()


async def _receiver_main(pipe: Any, module: str, size: int) -> None:
    from pdcluster.bench.transfer_paths import _Cache

    torch.set_num_threads(1)
    srv = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_raw_sink, args=(srv, size), daemon=True).start()
    recv = importlib.import_module(module).TCPConnector(SECRET, importer=_Cache())
    port = await recv.listen()
    pipe.send((srv.getsockname()[1], port))
    load_spec = importlib.import_module(module).LoadSpec
    pending: set[asyncio.Task[None]] = set()

    async def finish(rid: str) -> None:
        await recv.wait_for_load(rid, timeout=300)
        recv.finish_load(rid)

    while True:
        msg = await asyncio.to_thread(pipe.recv)
        if msg is None:
            break
        rid, tokens = msg
        recv.start_load_kv(load_spec(rid, 1, tokens, HEADS, DIM))
        t = asyncio.ensure_future(finish(rid))
        pending.add(t)
        t.add_done_callback(pending.discard)
        pipe.send("ready")
    await recv.close()
    srv.close()


def _receiver(pipe: Any, module: str, size: int) -> None:
    asyncio.run(_receiver_main(pipe, module, size))


def _raw_once(sock: socket.socket, data: memoryview) -> float:
    t0 = time.perf_counter()
    sock.sendall(_LEN.pack(len(data)))
    sock.sendall(data)
    if sock.recv(1) != b"k":
        raise RuntimeError("raw sink closed")
    return time.perf_counter() - t0


async def _backend_once(send: Any, pipe: Any, port: int, module: Any, rid: str, src: torch.Tensor,
                        src_scales: torch.Tensor | None) -> float:
    tokens = src.shape[1]
    pipe.send((rid, tokens))
    if await asyncio.to_thread(pipe.recv) != "ready":
        raise RuntimeError("receiver not ready")
    send.start_save(rid, module.TransferTarget("127.0.0.1", port), 1)
    t0 = time.perf_counter()
    size = src.numel() * src.element_size() + (src_scales.numel() * 4 if src_scales is not None else 0)
    buf = send.export_buffer(rid, 0, 0, size, quantized=src_scales is not None)
    if buf is None:
        buf = torch.empty(size, dtype=torch.uint8)  # what the engine does when the connector lends nothing
    kv = buf[:src.numel() * src.element_size()].view(src.dtype).view(src.shape)
    kv.copy_(src)  # the engine's gather out of its paged cache
    kw: dict[str, Any] = {}
    if src_scales is not None:
        sc = buf[src.numel():].view(torch.float32).view(src_scales.shape)
        sc.copy_(src_scales)
        kw["scales"] = (sc[0], sc[1])
    send.save_kv_layer(rid, 0, kv[0], kv[1], **kw)
    await send.wait_for_save(rid)
    return time.perf_counter() - t0


async def _sender(nbytes: int, reps: int, modules: list[str], pipes: list[Any], ports: list[tuple[int, int]],
                  cases: tuple[tuple[str, str, bool], ...]) -> dict[str, list[float]]:
    from pdcluster.kernels.kv_quant import quantize_kv

    tokens = max(1, nbytes // (2 * HEADS * DIM * 4))
    fp32 = 2 * tokens * HEADS * DIM * 4
    src = torch.randn(2, tokens, HEADS, DIM, generator=torch.Generator().manual_seed(0))
    q, s = quantize_kv(src, bits=8)
    data = memoryview(bytearray(nbytes))
    raws = [socket.create_connection(("127.0.0.1", p[0])) for p in ports]
    mods = [importlib.import_module(m) for m in modules]
    senders = {(i, name): mods[i].TCPConnector(SECRET, compression=comp)
               for i in range(len(modules)) for name, comp, _ in cases}
    times: dict[str, list[float]] = {}
    for rnd in range(reps + 1):  # round 0 warms up (connections, first-touch of every buffer)
        for i, m in enumerate(modules):
            tag = "" if i == 0 else f"@{m}"
            dt = _raw_once(raws[i], data)
            if rnd:
                times.setdefault("raw" + tag, []).append(nbytes / dt)
            for name, _, codes in cases:
                dt = await _backend_once(senders[(i, name)], pipes[i], ports[i][1], mods[i], f"{name}-{rnd}",
                                         q if codes else src, s if codes else None)
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
    every repeat kept under "runs"."""
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
    return {"mib": nbytes >> 20, **{k: statistics.median(v) / 1e9 for k, v in runs.items()},
            "runs": {k: [x / 1e9 for x in v] for k, v in runs.items()}}
