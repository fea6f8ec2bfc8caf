"""Side-by-side throughput of the KV transfer paths for one message size (used by disagg_transfer).

- raw TCP: two blocking sockets over loopback, sendall from one thread, recv_into one buffer in another
  (the ceiling for any TCP transport on this machine; no Python per byte);
- TCP backend: the real connector (handshake, GMAC per frame part, ACKs) moving one layer whose K+V is the
  message, from the export (K and V gathered back to back: one copy) to the receiver's cache (one copy):
  fp32, int8 compression of a float cache, or an int8 cache's codes as they are;
- NIXL backend: the real NixlConnector, same three cases: the export gathers into its registered staging,
  a STAGED frame goes over the authenticated channel, the receiver READs over UCX into its staging, checks
  the MAC and imports from there; both ends in one process (UCX shared memory);
- NIXL: a UCX agent WRITE of a registered host buffer into another process's registered buffer (the data
  plane a NIXL backend uses), timed on the initiator.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time
from typing import Any

import torch

from pdcluster.worker.transfer.connector import LoadSpec, TCPConnector, TransferTarget
from pdcluster.worker.transfer.options import TransferOptions

SECRET = b"bench-secret-0123456789abcdef"
HEADS, DIM = 8, 128


def raw_tcp(nbytes: int, reps: int) -> float:
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    sink = bytearray(nbytes)
    done = threading.Event()

    def receive() -> None:
        conn, _ = srv.accept()
        view = memoryview(sink)
        for _ in range(reps):
            got = 0
            while got < nbytes:
                got += conn.recv_into(view[got:])
        conn.sendall(b"k")
        conn.close()
        done.set()

    t = threading.Thread(target=receive)
    t.start()
    cli = socket.create_connection(("127.0.0.1", port))
    data = memoryview(bytearray(nbytes))
    t0 = time.perf_counter()
    for _ in range(reps):
        cli.sendall(data)
    cli.recv(1)
    dt = time.perf_counter() - t0
    t.join()
    cli.close()
    srv.close()
    return nbytes * reps / dt / 1e9


def _connector(backend: str, nbytes: int, compression: str = "none", **kw: Any) -> TCPConnector:
    options = TransferOptions(compression=compression)
    if backend == "tcp":
        return TCPConnector(SECRET, options, **kw)
    from pdcluster.worker.transfer.nixl_connector import NixlConnector

    return NixlConnector(SECRET, options, staging_bytes=nbytes + (1 << 20), **kw)


class _Cache:
    """Stands in for the decode worker's cache: the importer copies each range into it (the cache write a
    real import does), in whatever form arrived (float values, or codes + scales)."""

    def __init__(self) -> None:
        self.dst: dict[tuple[torch.dtype, tuple[int, ...]], torch.Tensor] = {}

    def _into(self, t: torch.Tensor) -> None:
        key = (t.dtype, tuple(t.shape))
        if key not in self.dst:
            self.dst[key] = torch.empty_like(t)
        self.dst[key].copy_(t)

    def __call__(self, rid: str, layer: int, k: torch.Tensor, v: torch.Tensor, *, token_start: int = 0,
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        for t in (k, v, *(scales or ())):
            self._into(t)


async def tcp_backend(nbytes: int, reps: int, compression: str, backend: str = "tcp",
                      codes: bool = False, device: str = "cpu") -> float | None:
    """GB/s of fp32 KV moved (for int8: the fp32 bytes the KV stands for, i.e. what the user gets), through
    the TCP backend or (backend="nixl") the NIXL backend, timed from the engine's export to the last byte in
    the receiver's cache: the export gathers K and V back to back into the connector's buffer (NIXL: its
    registered staging), the connector sends (TCP frames / STAGED + UCX READ + MAC check), the importer copies
    into a cache. `codes`: an int8 cache's codes + scales as they are (no quantize, no dequantize);
    compression="int8" on a float cache quantizes on the sender. `device="cuda"`: the prefill side's cache is
    on the GPU (the export is a device-to-host copy into the connector's buffer)."""
    if backend == "nixl":
        from pdcluster.worker.transfer.nixl_agent import availability

        if not availability().ok:
            return None
    tokens = max(1, nbytes // (2 * HEADS * DIM * 4))
    recv = _connector(backend, nbytes, importer=_Cache())
    port = await recv.listen()
    send = _connector(backend, nbytes, compression=compression)
    g = torch.Generator().manual_seed(0)
    src = torch.randn(2, tokens, HEADS, DIM, generator=g)  # the prefill side's cache (one layer)
    src_scales = None
    if codes:
        from pdcluster.kernels import quantize_kv

        q, s = quantize_kv(src, bits=8)
        src, src_scales = q, s
    src = src.to(device)
    src_scales = src_scales.to(device) if src_scales is not None else None
    best = float("inf")
    for rep in range(reps):
        rid = f"b-{compression}-{codes}-{nbytes}-{rep}"
        recv.start_load_kv(LoadSpec(rid, 1, tokens, HEADS, DIM))
        send.start_save(rid, TransferTarget("127.0.0.1", port), 1)
        t0 = time.perf_counter()
        size = src.numel() * src.element_size() + (src_scales.numel() * 4 if src_scales is not None else 0)
        buf = send.export_buffer(rid, 0, 0, size, quantized=codes)
        if buf is None:
            buf = torch.empty(size, dtype=torch.uint8)
        kv = buf[:src.numel() * src.element_size()].view(src.dtype).view(src.shape)
        kv.copy_(src)  # the engine's gather out of its paged cache
        scales = None
        if src_scales is not None:
            sc = buf[src.numel():].view(torch.float32).view(src_scales.shape)
            sc.copy_(src_scales)
            scales = (sc[0], sc[1])
        send.save_kv_layer(rid, 0, kv[0], kv[1], **({"scales": scales} if scales else {}))
        await send.wait_for_save(rid)
        await recv.wait_for_load(rid, timeout=120)
        best = min(best, time.perf_counter() - t0)
        recv.finish_load(rid)
    await send.close()
    await recv.close()
    return 2 * tokens * HEADS * DIM * 4 / best / 1e9


def _nixl_target(nbytes: int, meta_q: Any, done_q: Any) -> None:
    from pdcluster.worker.transfer.nixl_agent import Agent

    a = Agent("bench-target", nbytes)
    meta_q.put((a.metadata(), a.base))
    done_q.get(timeout=300)
    a.close()


def nixl_write(nbytes: int, reps: int) -> float | None:
    from pdcluster.worker.transfer.nixl_agent import Agent, availability

    if not availability().ok:
        return None
    ctx = mp.get_context("spawn")
    meta_q, done_q = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_nixl_target, args=(nbytes, meta_q, done_q))
    p.start()
    try:
        meta, base = meta_q.get(timeout=120)
        a = Agent("bench-initiator", nbytes)
        peer = a.add_remote(meta)
        a.write(peer, 0, base, nbytes)  # connection set-up is not throughput
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            a.write(peer, 0, base, nbytes)
            best = min(best, time.perf_counter() - t0)
        a.close()
        return nbytes / best / 1e9
    finally:
        done_q.put(True)
        p.join(30)
