"""A follower rank's own KV transfer endpoint (the direct path between tensor-parallel layouts): a connector
and listener of the worker's backend in this rank's process, sending this rank's KV heads straight to the
decode ranks that own them and writing the heads it receives into this rank's cache.

Rank 0 starts it with a ``kv_listen`` control line (parallel/control.py) naming this class, then drives it:
``load`` (expect a request's head ranges, with the slots its blocks give), ``cancel``, ``finish_save``
(answer once every route is acknowledged) and ``abort_save``; the engine's layer hook calls ``save`` inside
the forward. Every outcome goes back to rank 0, which owns the block manager and the request: ``kv_ready``,
``load_ready``, ``loaded`` / ``load_failed``, ``saved`` / ``save_failed``, ``stats``. Nothing here goes over
the step group: the gloo ranks carry no KV on this path.

``PDCLUSTER_TEST_TP_KILL_AFTER_LAYER=k`` (tests only): this rank SIGKILLs itself right after sending (prefill)
or importing (decode) layer ``k`` of its first request, so "a rank dies mid-transfer" is deterministic.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from typing import Any

import torch

from pdcluster.worker.transfer import backend as transfer_backend
from pdcluster.worker.transfer import head_slice, reshard
from pdcluster.worker.transfer.channel import TransferError
from pdcluster.worker.transfer.connector import LoadSpec
from pdcluster.worker.transfer.options import TransferOptions

log = logging.getLogger("pdcluster.tp.endpoint")
KILL_ENV = "PDCLUSTER_TEST_TP_KILL_AFTER_LAYER"


class RankEndpoint:
    def __init__(self, *, rank: int, size: int, runner: Any, lock: threading.Lock, reply: Any,
                 options: dict[str, Any]) -> None:
        self.rank, self.size, self.runner, self.lock, self.reply = rank, size, runner, lock, reply
        self.num_kv_heads, self.num_layers = int(options["num_kv_heads"]), int(options["num_layers"])
        transfer = TransferOptions(**options["transfer"])  # rank 0's flags, its backend choice made
        self.timeout = transfer.timeout_s
        self.saving: dict[str, list[head_slice.HeadRoute]] = {}
        self.slots: dict[str, torch.Tensor] = {}
        kill = os.environ.get(KILL_ENV)
        self.kill_after = int(kill) if kill else None
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name=f"pdcluster-tp-kv-{rank}", daemon=True).start()
        self.conn, choice = transfer_backend.build(transfer, bytes.fromhex(options["secret"]), importer=self._import)
        base = int(options["port_base"])  # rank 0's fixed --kv-transfer-port: this rank takes base + rank
        port = self._run(self.conn.listen(str(options["host"]), base + rank if base else 0))
        log.info("tensor-parallel rank %d: kv transfer (%s) listening on port %d", rank, choice.backend, port)
        reply({"op": "kv_ready", "port": port, "backend": choice.backend})

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    # ------------------------------------------------------------------ sender (the step's layer hook)
    def save(self, rid: str, targets: list[tuple[str, int]], layer: int, token_start: int,
             slots: torch.Tensor) -> None:
        routes = self.saving.get(rid)
        if routes is None:
            plan = reshard.plan(self.num_kv_heads, self.size, len(targets))
            routes = self.saving[rid] = head_slice.routes(reshard.sends(plan, self.rank), targets)
            if routes:
                self._run(self._begin(rid, routes))
        if not routes:  # replicated heads: another prefill rank sends the ones we hold
            return
        cache, n = self.runner.cache, int(slots.numel())
        nbytes = cache.export_bytes(layer, n)
        buf = self.conn.export_buffer(rid, layer, token_start, nbytes, cache.is_quantized(layer))
        k, v, scales = cache.export_into(layer, slots, buf if buf is not None else torch.empty(nbytes, dtype=torch.uint8))
        self.conn.save_kv_layer(rid, layer, k, v, token_start=token_start,
                                **({"scales": scales} if scales is not None else {}))
        if self.kill_after == layer:
            time.sleep(0.5)  # this layer's frames leave; the next layer's never will
            os.kill(os.getpid(), signal.SIGKILL)

    async def _begin(self, rid: str, routes: list[head_slice.HeadRoute]) -> None:
        self.conn.start_save_heads(rid, routes, self.num_layers)

    # ------------------------------------------------------------------ receiver
    async def _import(self, rid: str, layer: int, k: torch.Tensor, v: torch.Tensor, *, token_start: int = 0,
                      scales: Any = None, head_offset: int = 0) -> None:
        slots = self.slots[rid][token_start:token_start + int(k.shape[0])]
        await asyncio.to_thread(self._write, layer, k, v, slots, head_offset, scales)
        if self.kill_after == layer:
            os.kill(os.getpid(), signal.SIGKILL)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, head_offset: int,
               scales: Any) -> None:
        with self.lock:  # never while this rank's step reads or writes the cache
            head_slice.write_heads(self.runner.cache, layer, k, v, slots, head_offset, scales)

    # ------------------------------------------------------------------ rank 0's commands
    def command(self, msg: dict[str, Any]) -> None:
        asyncio.run_coroutine_threadsafe(self._handle(msg), self.loop)

    async def _handle(self, msg: dict[str, Any]) -> None:
        op, rid = msg.get("op"), str(msg.get("rid", ""))
        if op == "load":
            self.slots[rid] = torch.tensor(msg["slots"], dtype=torch.int64)
            self.conn.start_load_kv(LoadSpec(rid, self.num_layers, int(msg["tokens"]), int(msg["kv_heads"]),
                                             int(msg["head_dim"]), int(msg["head_offset"]),
                                             tuple((int(a), int(b)) for a, b in msg["pieces"])))
            self.reply({"op": "load_ready", "rid": rid})
            await self._await_load(rid)
        elif op == "cancel":
            self.conn.cancel_load(rid)
            self.slots.pop(rid, None)
        elif op == "finish_save":
            await self._finish_save(rid)
        elif op == "abort_save":
            if self.saving.pop(rid, None):
                await self.conn.abort_save(rid)
        elif op == "stats":
            reg = getattr(self.conn, "registrations", None)
            self.reply({"op": "stats", "rank": self.rank, "pending_loads": len(self.conn.pending_loads()),
                        "saving": len(self.saving), "registrations": reg() if reg is not None else None})

    async def _await_load(self, rid: str) -> None:
        try:
            # a load waits from its reservation on (prefill comes first): as long as rank 0's reaper lets it
            await self.conn.wait_for_load(rid, timeout=2 * self.timeout + 5)
            nbytes, _ = self.conn.finish_load(rid)
            self.reply({"op": "loaded", "rid": rid, "bytes": nbytes})
        except (TransferError, TimeoutError) as e:
            self.conn.cancel_load(rid)
            self.reply({"op": "load_failed", "rid": rid, "error": str(e) or type(e).__name__})
        finally:
            self.slots.pop(rid, None)

    async def _finish_save(self, rid: str) -> None:
        routes = self.saving.pop(rid, None)
        if not routes:
            self.reply({"op": "saved", "rid": rid, "bytes": 0, "seconds": 0.0})
            return
        try:
            res = await self.conn.wait_for_save(rid)
            self.reply({"op": "saved", "rid": rid, "bytes": res.bytes, "seconds": res.seconds})
        except TransferError as e:
            self.reply({"op": "save_failed", "rid": rid, "error": str(e)})
