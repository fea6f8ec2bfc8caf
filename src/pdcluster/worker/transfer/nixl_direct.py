"""NIXL from cache blocks to cache blocks: the pieces the NIXL backend needs to READ a float layer straight out
of the sender's KV cache into the receiver's, with no staging copy on either side.

Both workers register their cache pools with their agent once (`NixlConnector.register_cache`). The sender
then describes a layer's token range where it lies — K's runs of consecutive slots, then V's, as the engine
hands them to `save_kv_views` — as the segments of one STAGED descriptor, MACed over those bytes in wire
order. The receiver asks its engine where the same range lies in its own cache (`placing.Destination`),
pairs the two lists of segments (`pair`: the block sizes of the two sides need not agree), READs, and checks
the MAC over the bytes where they landed. A layer that fails it fails the load: the request never decodes
from those blocks.

Why this is safe:
- sender: views are offered only for a request's last prefill chunk, whose blocks stay untouched until the
  worker releases them after `wait_for_save` (every layer READ and ACKed) or `abort_save` (views.py). A READ
  that comes after an abort reads whatever the blocks hold by then, and its MAC fails;
- receiver: a READ in flight writes into blocks reserved for that request. `Inflight` counts them per
  request, and the worker awaits `settle` after `cancel_load` and before it frees the reservation, so no
  block is reused while a READ may still land in it (a READ nobody waits for any more, after a timeout or a
  cancel, is drained on a thread: `Agent._drain`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pdcluster.worker.transfer import handoff, nixl_wire
from pdcluster.worker.transfer.channel import TransferError
from pdcluster.worker.transfer.codec import TORCH_OF, WIRE_OF
from pdcluster.worker.transfer.frame import ErrorCode, Frame, Kind
from pdcluster.worker.transfer.head_slice import Fanout
from pdcluster.worker.transfer.nixl_agent import Agent, Segments
from pdcluster.worker.transfer.specs import Received, _Load


def addresses(views: list[memoryview]) -> Segments:
    """Where each (non-empty) byte view lies."""
    return [(int(np.frombuffer(v, dtype=np.uint8).ctypes.data), len(v)) for v in views if len(v)]


def pair(local: Segments, remote: Segments) -> tuple[Segments, Segments]:
    """Cut two lists of segments holding the same bytes in the same order at every boundary of either, so
    that they pair up one for one (what a NIXL transfer takes). Raises ValueError when the totals differ."""
    if sum(n for _, n in local) != sum(n for _, n in remote):
        raise ValueError("local and remote segments hold different byte counts")
    out_l: Segments = []
    out_r: Segments = []
    i = j = 0
    li = ri = 0  # bytes of local[i] / remote[j] already paired
    while i < len(local) and j < len(remote):
        (la, ln), (ra, rn) = local[i], remote[j]
        n = min(ln - li, rn - ri)
        out_l.append((la + li, n))
        out_r.append((ra + ri, n))
        li, ri = li + n, ri + n
        if li == ln:
            i, li = i + 1, 0
        if ri == rn:
            j, ri = j + 1, 0
    return out_l, out_r


class Inflight:
    """READs in flight into each request's cache blocks. `end` may come from any thread (a drained READ)."""

    def __init__(self) -> None:
        self._count: dict[str, int] = {}
        self._lock = threading.Lock()

    def begin(self, request_id: str) -> None:
        with self._lock:
            self._count[request_id] = self._count.get(request_id, 0) + 1

    def end(self, request_id: str) -> None:
        with self._lock:
            left = self._count.get(request_id, 0) - 1
            if left > 0:
                self._count[request_id] = left
            else:
                self._count.pop(request_id, None)

    def count(self, request_id: str | None = None) -> int:
        with self._lock:
            return sum(self._count.values()) if request_id is None else self._count.get(request_id, 0)

    async def settle(self, request_id: str, timeout: float) -> bool:
        """Wait until no READ may still write into this request's blocks; False after `timeout`."""
        deadline = time.monotonic() + timeout
        while self.count(request_id):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(1e-3)  # a cancel is rare, and a READ ends within its own timeout
        return True


_EMPTY = torch.empty(0)  # K and V of a layer already READ into the cache: nothing left to import


class DirectPath:
    """The cache-to-cache half of `NixlConnector` (a mixin: the attributes below are the connector's)."""

    agent: Agent
    secret: bytes
    compression: str
    timeout: float
    destination: Any
    direct: bool
    direct_layers: list[int]
    _metadata: bytes
    _inflight: Inflight
    _readers: concurrent.futures.ThreadPoolExecutor
    _out_lock: threading.Lock
    _out: dict[str, Any]
    _outboxes: dict[str, Any]
    _loads: dict[str, _Load]
    _loop: asyncio.AbstractEventLoop | None
    _remotes: OrderedDict[str, bytes]
    integrity: str  # mac | fabric

    def _tag(self, salt: bytes, request_id: str, layer: int, token_start: int,
             data: memoryview | list[memoryview], head_start: int = 0) -> bytes:
        """The MAC of bytes about to be described in a STAGED frame; none (zeros) when the fabric is trusted."""
        if self.integrity == "fabric":
            return bytes(nixl_wire.TAG_SIZE)
        return nixl_wire.mac(self.secret, salt, request_id, layer, token_start, data, head_start)

    @staticmethod
    def _refused(frame: Frame, d: nixl_wire.Descriptor, what: str) -> TransferError:
        why = ("the sender sent no MAC: it runs --kv-transfer-integrity fabric, run both sides alike"
               if d.tag == bytes(nixl_wire.TAG_SIZE) else "tampered, or the memory was reused before the READ")
        return TransferError(f"{what} of layer {frame.layer} fail their MAC ({why}): not imported",
                             ErrorCode.UNAUTHENTICATED)

    def _remote(self, d: nixl_wire.Descriptor) -> str:
        raise NotImplementedError

    def _forget(self, name: str) -> None:
        raise NotImplementedError

    def _small(self, d: nixl_wire.Descriptor) -> bool:
        raise NotImplementedError

    def register_cache(self, tensors: list[torch.Tensor]) -> None:
        """Register the engine's KV cache pools once, before serving: float layers then go from the sender's
        cache blocks to the receiver's (nixl_direct.py). Device pools and non-contiguous ones are left out
        (their layers keep the staging path); peers learn the registrations from every descriptor's metadata."""
        host = [t for t in tensors if t.device.type == "cpu" and t.is_contiguous()]
        if host:
            self.agent.register(host)
            self._metadata = self.agent.metadata()
            self.direct = True

    async def settle(self, request_id: str, timeout: float = 660.0) -> bool:
        """After `cancel_load`, before the owner frees the request's blocks: wait until no READ may still land
        in them (a drained READ ends within its drain limit, 600 s). False after `timeout`."""
        return await self._inflight.settle(request_id, timeout)

    def save_kv_views(self, request_id: str, layer: int, parts: list[memoryview], *, token_start: int,
                      num_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                      held: Callable[[], bool] | None = None) -> bool:
        """Engine thread: a float layer's token range described where it lies in the registered cache (one
        STAGED frame, its MAC over those bytes), no gather and no staging. False (gather it for
        save_kv_layer): cache not registered, wire compression, head ranges, or too many pieces for a
        descriptor."""
        entry = self._outboxes.get(request_id)
        if entry is None or self._loop is None:
            return True  # aborted meanwhile: nothing to send
        box, num_layers = entry
        if not self.direct or self.compression != "none" or isinstance(box, Fanout) or dtype not in WIRE_OF \
                or dtype in (torch.int8, torch.uint8):
            return False
        segs = addresses(parts)
        nbytes = sum(n for _, n in segs)
        if nbytes != 2 * num_tokens * kv_heads * head_dim * dtype.itemsize or len(segs) > nixl_wire.MAX_SEGMENTS \
                or not all(self.agent.covers(a, n) for a, n in segs):
            return False
        with self._out_lock:
            out = self._out.get(request_id)
        if out is None:
            return True
        tag = self._tag(out.salt, request_id, layer, token_start, [memoryview(p).cast("B") for p in parts])
        try:
            desc = nixl_wire.Descriptor(segs[0][0], nbytes, 0, out.salt, tag, self.agent.name, self._metadata,
                                        tuple(segs) if len(segs) > 1 else ()).pack()
        except nixl_wire.DescriptorError:
            return False  # more pieces than a descriptor holds: staged instead
        with self._out_lock:
            now = self._out.get(request_id)
            if now is None or now is not out:
                return True  # aborted meanwhile
            now.staged_bytes += nbytes
            now.descriptor_bytes += len(desc)
        self.direct_layers[0] += 1
        frame = Frame(kind=Kind.STAGED, request_id=request_id, layer=layer, num_layers=num_layers,
                      token_start=token_start, token_end=token_start + num_tokens, kv_heads=kv_heads,
                      head_dim=head_dim, dtype=WIRE_OF[dtype], payload=desc, held=held)
        loop = self._loop

        def put() -> None:  # on the loop; dropped once the save has ended
            if request_id in self._outboxes:
                box.put(frame)

        put() if handoff.on_loop(loop) else loop.call_soon_threadsafe(put)
        return True

    def _destination(self, frame: Frame, d: nixl_wire.Descriptor
                     ) -> tuple[list[memoryview], Segments, Callable[[], None]] | None:
        """Where a float layer's range lies in this worker's registered cache, when it can be READ there
        directly (placing.py's conditions, plus registered memory); None: through staging, as before."""
        load = self._loads.get(frame.request_id)
        if not self.direct or self.destination is None or frame.quantized or load is None or load.spec.pieces:
            return None
        got = self.destination(frame.request_id, frame.layer, frame.token_start, frame.num_tokens,
                               TORCH_OF[frame.dtype])
        if got is None:
            return None
        views, release = got
        segs = addresses(views)
        if sum(n for _, n in segs) != d.nbytes or not all(self.agent.covers(a, n) for a, n in segs):
            release()
            return None
        return views, segs, release

    async def _read_direct(self, frame: Frame, d: nixl_wire.Descriptor, views: list[memoryview], local: Segments,
                           release: Callable[[], None]) -> Received:
        """READ the sender's segments straight into this cache's blocks, then check the MAC where they landed."""
        rid = frame.request_id
        self._inflight.begin(rid)

        def ended() -> None:  # the READ can no longer write into the blocks (see settle)
            release()
            self._inflight.end(rid)

        if not await self._read_checked(frame, d, local, views, ended):
            raise self._refused(frame, d, "bytes read from the sender's cache")
        self.direct_layers[1] += 1
        return Received(_EMPTY, _EMPTY, None, d.nbytes, placed=True)

    async def _read_checked(self, frame: Frame, d: nixl_wire.Descriptor, local: Segments,
                            data: memoryview | list[memoryview], ended: Callable[[], None]) -> bool:
        """READ the sender's bytes (`d.parts`) into `local` (registered memory) and check their MAC over `data`
        (the same memory, as views). A small layer from a peer already added is READ polled on the loop; any
        other does lookup, READ and MAC check in one call on a reader thread (a hop each, and back, was most
        of what a small layer took). `ended` runs exactly once, when nothing more can land in `local` (also
        when the READ never started). Raises TransferError(INTERNAL) when the READ fails: retryable."""

        def check() -> bool:
            return self.integrity == "fabric" or nixl_wire.verify(self.secret, d, frame.request_id, frame.layer,
                                                                  frame.token_start, data, frame.head_start)

        def post(read: Callable[..., Any]) -> Any:
            try:
                peer = self._remote(d)
                segs = pair(local, list(d.parts))
            except BaseException:
                ended()
                raise
            return read(peer, *segs, d.device, self.timeout, ended)

        def fetch() -> bool:
            post(self.agent.read_segments)
            return check()

        try:
            if self._small(d):
                await post(self.agent.aread_segments)
                return check()
            job = self._readers.submit(fetch)
            try:
                return await asyncio.wrap_future(job)
            except asyncio.CancelledError:
                if job.cancel():  # never started: nothing will land, and `ended` would never run
                    ended()
                raise
        except Exception as e:  # peer gone, restarted, or a range it no longer registers: retryable
            self._forget(d.agent)
            raise TransferError(f"nixl read from {d.agent} failed: {e}", ErrorCode.INTERNAL) from e


class Hold:
    """Runs `free` once `parties` have each dropped their hold (a staging region: the READ into it has ended,
    and whoever reads it is done)."""

    def __init__(self, parties: int, free: Callable[[], None]) -> None:
        self._left, self._free, self._lock = parties, free, threading.Lock()

    def drop(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._free()
