"""One tensor-parallel rank slot of re-sharded KV transfers, as its own OS process (`child`, started by
`reshard_procs.run` from a forkserver that imported this module, and so torch, once; for
tests/transfer/test_reshard_procs.py). It talks to the parent over a pipe.

A process is one slot (prefill rank r, or decode rank r) with one connector, and plays that rank in every
case (one request each: heads, prefill TP a, decode TP b) whose layout has it. Every rank builds the case's
full-head KV from a seed and keeps only its own heads (the engine's rule, `parallel.heads`) in a real
`PagedKVCache` whose blocks come from a real `BlockManager`, scattered. A sender exports each layer as the
engine does (`export_buffer`, then `export_into`: codes as stored) and saves it through the plan's head
routes (or `start_save`, today's path, for a `whole` case). A receiver starts every case's load, prints its
port, imports the planned head ranges (`write_heads`) and checks its cache against its heads of the full KV.
Each sends back its results, leak counts included.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from pdcluster.kernels.kv_quant import dequantize_kv, quantize_kv
from pdcluster.worker.engine.block_manager import BlockManager
from pdcluster.worker.engine.kv_cache import PagedKVCache
from pdcluster.worker.engine.parallel.heads import kv_heads_of_rank
from pdcluster.worker.transfer import head_slice, reshard
from pdcluster.worker.transfer.channel import TransferError
from pdcluster.worker.transfer.connector import LoadSpec, TCPConnector, TransferTarget
from pdcluster.worker.transfer.options import TransferOptions

SECRET = b"r" * 32
BLOCK = 8
Case = dict[str, Any]


def full_kv(case: Case, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(case["seed"] * 1000 + layer)
    shape = (case["tokens"], case["heads"], case["dim"])
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


def connector(cfg: dict[str, Any]) -> TCPConnector:
    options = TransferOptions(compression=cfg.get("compression", "none"), timeout_s=cfg.get("timeout", 20.0),
                              max_retries=1)
    if cfg["backend"] == "nixl":
        from pdcluster.worker.transfer.nixl_connector import NixlConnector

        return NixlConnector(SECRET, options, staging_bytes=cfg.get("staging_bytes", 64 << 20), encoder_threads=1)
    return TCPConnector(SECRET, options, encoder_threads=1)


class Rank:
    """One case's cache at one rank: its heads, blocks from a block manager, the slots its tokens use."""

    def __init__(self, case: Case, tp: int, rank: int) -> None:
        self.case, self.own = case, kv_heads_of_rank(case["heads"], tp, rank)
        need = -(-case["tokens"] // BLOCK)
        self.cache = PagedKVCache(case["layers"], need + 2, BLOCK, len(self.own), case["dim"],
                                  kv_dtype=case.get("kv_dtype", "auto"))
        self.blocks = BlockManager(need + 2, BLOCK, enable_prefix_caching=False)
        self.pad = self.blocks.allocate_blocks(2) or []  # so the request's blocks are not 0.. in order
        self.table = self.blocks.allocate_blocks(need) or []
        self.slots = torch.tensor([self.table[t // BLOCK] * BLOCK + t % BLOCK for t in range(case["tokens"])])

    def expected(self, layer: int) -> list[torch.Tensor]:
        return [x[:, self.own.start:self.own.stop] for x in full_kv(self.case, layer)]

    def max_error(self) -> float:
        """Largest difference from this rank's heads of the full KV, as the cache stores them (an int8
        cache: against the codes quantizing those values gives, so 0 means bit-exact codes)."""
        worst = 0.0
        for layer in range(self.case["layers"]):
            want = self.expected(layer)
            if self.cache.is_quantized(layer):
                want = [dequantize_kv(*quantize_kv(x, 8), 8) for x in want]
            got = self.cache.read(layer, torch.tensor(self.table), self.case["tokens"])
            worst = max(worst, *((g - w).abs().max().item() for g, w in zip(got, want, strict=True)))
        return worst

    def free(self) -> int:
        """Give the blocks back; how many stay in use (leaked)."""
        self.blocks.free_blocks(self.table)
        self.blocks.free_blocks(self.pad)
        return self.blocks.num_used_blocks


def registrations(conn: TCPConnector) -> dict[str, int]:
    return conn.registrations() if hasattr(conn, "registrations") else {}


async def send_case(conn: TCPConnector, case: Case, slot: int, ports: list[int]) -> dict[str, Any]:
    r = Rank(case, case["a"], slot)
    for layer in range(case["layers"]):
        k, v = r.expected(layer)
        r.cache.write(layer, k, v, r.slots)
    rid, plan = case["rid"], reshard.plan(case["heads"], case["a"], case["b"])
    routes = head_slice.routes(reshard.sends(plan, slot), [("127.0.0.1", p) for p in ports])
    if case.get("whole"):  # today's path (TP 1 -> TP 1): start_save, no head routes
        (route,) = routes
        conn.start_save(rid, TransferTarget(route.host, route.port), case["layers"])
    else:
        conn.start_save_heads(rid, routes, case["layers"])
    t0 = time.perf_counter()
    for layer in range(case["layers"]):
        start = 0
        for n in case.get("chunks") or [case["tokens"]]:  # the engine's layer hook, per prefill chunk
            nbytes = r.cache.export_bytes(layer, n)
            buf = conn.export_buffer(rid, layer, start, nbytes, r.cache.is_quantized(layer))
            if buf is None:
                buf = torch.empty(nbytes, dtype=torch.uint8)
            k, v, scales = r.cache.export_into(layer, r.slots[start:start + n], buf)
            codes = {"scales": scales} if scales is not None else {}
            conn.save_kv_layer(rid, layer, k, v, token_start=start, **codes)
            start += n
    out: dict[str, Any] = {"routes": len(routes)}
    try:
        res = await conn.wait_for_save(rid)
        out.update(ok=True, bytes=res.bytes, seconds=time.perf_counter() - t0)
    except TransferError as e:
        out.update(ok=False, error=str(e), seconds=time.perf_counter() - t0)
    out["blocks_leaked"] = r.free()
    return out


async def send(cfg: dict[str, Any], pipe: Connection) -> dict[str, Any]:
    conn, slot = connector(cfg), cfg["slot"]
    ports = await asyncio.to_thread(pipe.recv)  # the receivers' ports, once they all listen
    cases = {}
    for c in cfg["cases"]:
        if slot < c["a"]:
            await asyncio.to_thread(pipe.recv)  # the parent's go: one case at a time on every sender
            cases[c["rid"]] = await send_case(conn, c, slot, ports[:c["b"]])
            pipe.send({"case": c["rid"]})
    out = {"slot": slot, "cases": cases, "registrations": registrations(conn), "outboxes": len(conn._outboxes)}
    await conn.close()
    return {**out, "closed": registrations(conn)}


async def receive(cfg: dict[str, Any], pipe: Connection) -> dict[str, Any]:
    conn, slot = connector(cfg), cfg["slot"]
    ranks = {c["rid"]: Rank(c, c["b"], slot) for c in cfg["cases"] if slot < c["b"]}

    def importer(rid: str, layer: int, k: torch.Tensor, v: torch.Tensor, *, token_start: int = 0,
                 scales: Any = None, head_offset: int = 0) -> None:
        r = ranks[rid]
        if r.case.get("die") == [slot, layer]:
            os.kill(os.getpid(), signal.SIGKILL)  # a decode rank dying mid-transfer
        slots = r.slots[token_start:token_start + k.shape[0]]
        head_slice.write_heads(r.cache, layer, k, v, slots, head_offset, scales)

    conn.importer = importer
    port = await conn.listen("127.0.0.1", 0)
    for rid, r in ranks.items():
        c = r.case
        pieces = () if c.get("whole") else head_slice.pieces_of(reshard.plan(c["heads"], c["a"], c["b"])[slot])
        conn.start_load_kv(LoadSpec(rid, c["layers"], c["tokens"], len(r.own), c["dim"], head_offset=r.own.start,
                                    pieces=pieces))
    pipe.send({"port": port})

    async def one(rid: str) -> dict[str, Any]:
        try:
            await conn.wait_for_load(rid, timeout=cfg.get("wait", 120.0))
            nbytes, secs = conn.finish_load(rid)
            return {"ok": True, "bytes": nbytes, "seconds": secs, "max_err": ranks[rid].max_error()}
        except (TransferError, TimeoutError) as e:
            conn.cancel_load(rid)  # what the worker does with a failed import: drop the reservation
            return {"ok": False, "error": str(e) or type(e).__name__}

    cases = dict(zip(ranks, await asyncio.gather(*(one(rid) for rid in ranks)), strict=True))
    for rid, r in ranks.items():
        cases[rid]["blocks_leaked"] = r.free()
    await asyncio.sleep(0.2)  # a READ still in flight (NIXL) gives its region back
    out = {"slot": slot, "cases": cases, "pending_loads": len(conn.pending_loads()),
           "registrations": registrations(conn)}
    await conn.close()
    return {**out, "closed": registrations(conn)}


def child(cfg: dict[str, Any], pipe: Connection) -> None:
    torch.set_num_threads(1)
    pipe.send(asyncio.run(send(cfg, pipe) if cfg["role"] == "send" else receive(cfg, pipe)))
