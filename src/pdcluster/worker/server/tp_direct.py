"""Rank 0's side of the direct KV path between tensor-parallel layouts: every rank of a TP worker has its own
transfer endpoint (rank 0's connector, and one per follower: tp_rank.py), a prefill rank sends its own heads
straight to the decode ranks that own them (`transfer/reshard.py` plans, `head_slice.py` cuts), and every
rank reports to rank 0, which owns the block manager and the request.

The path is chosen per request, never guessed: a decode worker takes it when the router says which prefill
TP will send (`/internal/reserve`'s ``prefill_tp``, given only when both workers advertise ``kv_direct`` in
`/internal/load` and the pair is not TP 1 -> TP 1) and then answers every rank's port (``rank_ports``); the
prefill worker takes it when its target carries those ports. Anything else is the relay through rank 0
(parallel/kv_relay.py), and a TP 1 -> TP 1 pair is exactly what it was (whole layers, version-3 frames).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from pdcluster.worker.api import errors
from pdcluster.worker.engine.parallel import kv_relay
from pdcluster.worker.engine.parallel.heads import kv_heads_of_rank
from pdcluster.worker.transfer import head_slice, reshard
from pdcluster.worker.transfer.channel import TransferError
from pdcluster.worker.transfer.connector import LoadSpec, SaveResult, TransferTarget

log = logging.getLogger(__name__)
START_TIMEOUT_S = 120.0
ENDPOINT = "pdcluster.worker.server.tp_rank:RankEndpoint"


def find_runner(engine: Any) -> Any:
    inner = getattr(engine, "engine", engine)
    return getattr(inner, "runner", None)


def decode_specs(rid: str, num_layers: int, tokens: int, num_kv_heads: int, head_dim: int, prefill_tp: int,
                 decode_tp: int) -> list[LoadSpec]:
    """Each decode rank's LoadSpec for KV coming from ``prefill_tp`` ranks: its heads, the ranges they come in."""
    plan = reshard.plan(num_kv_heads, prefill_tp, decode_tp)
    specs = []
    for rank in range(decode_tp):
        own = kv_heads_of_rank(num_kv_heads, decode_tp, rank)
        specs.append(LoadSpec(rid, num_layers, tokens, len(own), head_dim, own.start,
                              head_slice.pieces_of(plan[rank])))
    return specs


def _fail(fut: asyncio.Future[Any], e: Exception) -> None:
    fut.set_exception(e)
    fut.exception()  # retrieved: a wait nobody comes back for (a cancelled request) is not an error to log


class DirectKV:
    """The followers' endpoints as rank 0 sees them, and the per-request waits on their outcomes."""

    def __init__(self, disagg: Any, *, path: str = "auto") -> None:
        self.disagg = disagg  # internal_routes.Disaggregation: its connector, options and KV layout
        self.runner = find_runner(disagg.engine)
        self.control: Any = getattr(self.runner, "control", None)  # parallel/control.py (TP > 1)
        self.tp = int(getattr(self.runner, "tp", 1) or 1)
        self.num_layers, self.num_kv_heads, self.head_dim = disagg.num_layers, disagg.kv_heads, disagg.head_dim
        self.timeout = float(disagg.timeout)
        # --kv-transfer-port P: rank r listens on P + r (a NetworkPolicy can name the range); none: any free port
        self.port_base = int(disagg.transfer_port or 0)
        enabled = path != "relay" and disagg.connector is not None
        self.enabled, self.reason = enabled, "" if enabled else "--kv-transfer-tp-path relay, or no transfer secret"
        self.ports: list[int] = []
        self.sent, self.received = [0] * self.tp, [0] * self.tp
        self.dead: set[int] = set()
        self.expected: set[str] = set()  # requests the followers were told to expect and not yet done with
        self._waits: dict[tuple[str, str, int], asyncio.Future[dict[str, Any]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def followers(self) -> range:
        return range(1, self.tp)

    # ------------------------------------------------------------------ start-up
    async def start(self) -> None:
        """Start each follower's endpoint (its port comes back); any failure leaves the relay in charge."""
        self._loop = asyncio.get_running_loop()
        d = self.disagg
        port0 = d.transfer_port
        # the worker's transfer options, with the backend rank 0 settled on (every rank runs the same one)
        transfer = dataclasses.asdict(dataclasses.replace(d.options, backend=d.backend)) if self.enabled else {}
        options = {"secret": (d.secret or b"").hex(), "transfer": transfer, "host": d.listen_host,
                   "port_base": self.port_base,
                   "num_kv_heads": self.num_kv_heads, "num_layers": self.num_layers}
        if self.enabled and self.tp > 1:
            if self.control is None:
                self.enabled, self.reason = False, "the engine's runner has no control channel"
            else:
                self.control.listener = self._heard
                waits = [self._wait_for("kv", "", r) for r in self.followers]
                for r in self.followers:
                    self.control.send(r, {"op": "kv_listen", "factory": ENDPOINT, "options": options})
                try:
                    async with asyncio.timeout(START_TIMEOUT_S):
                        got = [await w for w in waits]
                    self.ports = [port0] + [int(g["port"]) for g in got]
                except (TransferError, TimeoutError) as e:
                    self.enabled, self.reason = False, f"a follower's endpoint did not start ({e or 'timeout'})"
        else:
            self.ports = [port0]
        if self.tp > 1 or not self.enabled:
            log.info("KV between TP layouts: %s", f"direct, one endpoint per rank (ports {self.ports})"
                     if self.enabled else f"relayed through rank 0 ({self.reason})")

    # ------------------------------------------------------------------ follower replies
    def _wait_for(self, kind: str, rid: str, rank: int) -> asyncio.Future[dict[str, Any]]:
        assert self._loop is not None
        fut = self._waits[(kind, rid, rank)] = self._loop.create_future()
        if rank in self.dead:
            _fail(fut, TransferError(f"tensor-parallel rank {rank} is gone"))
        return fut

    def _heard(self, rank: int, msg: dict[str, Any]) -> None:  # a reader thread
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._resolve, rank, msg)

    def _resolve(self, rank: int, msg: dict[str, Any]) -> None:
        op, rid = msg.get("op"), str(msg.get("rid", ""))
        if op == "gone":
            self.dead.add(rank)
            for (_, _, r), waiting in list(self._waits.items()):
                if r == rank and not waiting.done():
                    _fail(waiting, TransferError(f"tensor-parallel rank {rank} is gone"))
            return
        kind = {"kv_ready": "kv", "kv_failed": "kv", "load_ready": "ready", "loaded": "load",
                "load_failed": "load", "saved": "save", "save_failed": "save", "stats": "stats"}.get(str(op))
        fut = self._waits.get((kind or "", rid, rank))
        if fut is None or fut.done():
            return
        if op in ("kv_failed", "load_failed", "save_failed"):
            _fail(fut, TransferError(f"tensor-parallel rank {rank}: {msg.get('error')}"))
        else:
            fut.set_result(msg)

    async def _gather(self, kind: str, rid: str, timeout: float) -> list[dict[str, Any]]:
        futs = [self._waits.get((kind, rid, r)) for r in self.followers]
        try:
            if any(f is None for f in futs):
                raise TransferError(f"{kind} of {rid} was cancelled")
            async with asyncio.timeout(timeout):
                return [await f for f in futs if f is not None]
        except TimeoutError:
            raise TransferError(f"tensor-parallel ranks did not answer {kind} of {rid} in {timeout:g} s") from None
        finally:
            for r in self.followers:
                self._waits.pop((kind, rid, r), None)

    # ------------------------------------------------------------------ decode side
    def load_specs(self, rid: str, tokens: int, prefill_tp: int | None) -> list[LoadSpec]:
        """Every rank's LoadSpec when this request comes direct, else rank 0's for whole layers (the relay)."""
        if not self.enabled or prefill_tp is None or (prefill_tp, self.tp) == (1, 1):
            return [LoadSpec(rid, self.num_layers, tokens, self.num_kv_heads, self.head_dim)]
        return decode_specs(rid, self.num_layers, tokens, self.num_kv_heads, self.head_dim, prefill_tp, self.tp)

    async def expect(self, rid: str, specs: list[LoadSpec], engine: Any) -> dict[str, list[int]]:
        """Tell each follower what it receives of ``rid`` and where it goes (the slots of its reserved blocks,
        the same on every rank); back once all are listening, with what the reservation answers."""
        if not specs[0].pieces:  # whole layers to rank 0: the answer of before
            return {}
        if self.tp == 1:
            return {"rank_ports": self.ports}
        n = specs[0].num_tokens
        try:
            slots = await engine.call(lambda e: e.runner.slots(e.seqs[rid], 0, n).tolist())
        except KeyError:
            raise TransferError(f"{rid} is not reserved") from None
        self.expected.add(rid)
        for r in self.followers:
            self._wait_for("ready", rid, r)
            self._wait_for("load", rid, r)
        for r in self.followers:
            s = specs[r]
            self.control.send(r, {"op": "load", "rid": rid, "tokens": s.num_tokens, "kv_heads": s.kv_heads,
                                  "head_dim": s.head_dim, "head_offset": s.head_offset,
                                  "pieces": [list(p) for p in s.pieces], "slots": slots})
        await self._gather("ready", rid, self.timeout)
        return {"rank_ports": self.ports}

    def loading(self, rid: str) -> bool:
        return any(("load", rid, r) in self._waits for r in self.followers)

    async def wait_loaded(self, rid: str, timeout: float) -> int:
        """Every follower has its heads of every layer: the bytes they received."""
        got = await self._gather("load", rid, timeout)
        self.expected.discard(rid)
        for r, g in zip(self.followers, got, strict=True):
            self.received[r] += int(g.get("bytes", 0))
        return sum(int(g.get("bytes", 0)) for g in got)

    def cancel(self, rid: str) -> None:
        """Every follower drops what it expected of ``rid`` (its own wait may have failed already)."""
        for r in self.followers:
            for kind in ("load", "ready"):
                fut = self._waits.pop((kind, rid, r), None)
                if fut is not None:
                    fut.cancel()
        if rid in self.expected:
            self.expected.discard(rid)
            for r in self.followers:
                self.control.send(r, {"op": "cancel", "rid": rid})

    # ------------------------------------------------------------------ prefill side
    def check_target(self, rank_ports: list[int] | None) -> None:
        """A 400 before the stream starts when the decode ranks given cannot take this worker's KV heads
        (e.g. 3 ranks for 4 heads): inside the stream it would only break the connection."""
        if self.enabled and rank_ports and (self.tp, len(rank_ports)) != (1, 1):
            try:
                reshard.plan(self.num_kv_heads, self.tp, len(rank_ports))
            except ValueError as e:
                raise errors.bad_request(f"target.rank_ports: {e}", param="target.rank_ports") from None

    def start_save(self, rid: str, target: TransferTarget, rank_ports: list[int] | None
                   ) -> list[head_slice.HeadRoute] | None:
        """Start sending ``rid``: rank 0's head routes when it goes direct (the followers learn theirs from
        the step message) and those routes, else whole layers to ``target`` (the relay, or TP 1 -> TP 1)."""
        conn = self.disagg.connector
        if not self.enabled or not rank_ports or (self.tp, len(rank_ports)) == (1, 1):
            conn.start_save(rid, target, self.num_layers)
            return None
        targets = [(target.host, int(p)) for p in rank_ports]
        routes = head_slice.routes(reshard.sends(reshard.plan(self.num_kv_heads, self.tp, len(targets)), 0), targets)
        conn.start_save_heads(rid, routes, self.num_layers)
        if self.tp > 1:
            self.runner.direct[rid] = targets
        return routes

    async def wait_saved(self, rid: str, own: SaveResult) -> SaveResult:
        """Every follower's routes acknowledged too: the slowest rank's seconds, every rank's bytes."""
        self.sent[0] += own.bytes
        if self.tp == 1:
            return own
        for r in self.followers:
            self._wait_for("save", rid, r)
            self.control.send(r, {"op": "finish_save", "rid": rid})
        got = await self._gather("save", rid, 2 * self.timeout + 5)
        for r, g in zip(self.followers, got, strict=True):
            self.sent[r] += int(g.get("bytes", 0))
        return SaveResult(max([own.seconds] + [float(g.get("seconds", 0.0)) for g in got]),
                          own.bytes + sum(int(g.get("bytes", 0)) for g in got))

    def forget_save(self, rid: str, abort: bool) -> None:
        if self.tp > 1 and self.runner.direct.pop(rid, None) is not None and abort:
            for r in self.followers:
                self.control.send(r, {"op": "abort_save", "rid": rid})

    # ------------------------------------------------------------------ what /internal/load shows
    async def rank_stats(self) -> list[dict[str, Any]]:
        """Each rank's own count of pending loads, sends in progress and NIXL registrations (a dead follower
        says so): what leak checks read after requests end."""
        conn = self.disagg.connector
        if conn is None:
            return []
        reg = getattr(conn, "registrations", None)
        out = [{"rank": 0, "pending_loads": len(conn.pending_loads()), "saving": len(getattr(self.runner, "direct", ())),
                "registrations": reg() if reg is not None else None}]
        if not self.enabled:
            return out
        for r in self.followers:
            fut = self._wait_for("stats", "", r)
            self.control.send(r, {"op": "stats"})
            try:
                async with asyncio.timeout(5):
                    out.append(await fut)
            except (TransferError, TimeoutError):
                out.append({"rank": r, "dead": True})
            finally:
                self._waits.pop(("stats", "", r), None)
        return out

    def describe(self) -> dict[str, Any]:
        return {"tensor_parallel_size": self.tp, "kv_direct": self.enabled,
                "kv_rank_bytes": {"sent": list(self.sent), "received": list(self.received)},
                "kv_relay_bytes": dict(kv_relay.RELAYED)}
