"""Moving a head range of each layer instead of the whole layer: what a connector needs when prefill and
decode run different tensor-parallel layouts (`reshard.py` says which ranges go where).

Sender: `start_save_heads(request_id, routes, num_layers)` opens one outgoing transfer per route (one
decode rank, one head range); each `save_kv_layer` of the rank's own heads is then cut into the routes'
ranges (`slice_heads`, one copy of the range; none when a range is all the sender's heads) and each range
is encoded as today (int8 on the wire, codes as stored) with its first global head on the frame. `Fanout`
makes those transfers look like one to the connector: closed, awaited and aborted together.

Receiver: a `LoadSpec` with `pieces` accepts exactly those (first global head, count) ranges per layer and
hands each to its importer with `head_offset` (where the range starts in the receiver's own cache);
`write_heads` is that import for a `PagedKVCache`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdcluster.worker.engine.kv_transfer import store_heads
from pdcluster.worker.transfer import codec
from pdcluster.worker.transfer.frame import Frame
from pdcluster.worker.transfer.outbox import Outbox
from pdcluster.worker.transfer.reshard import Piece

if TYPE_CHECKING:
    from pdcluster.worker.engine.kv_cache import PagedKVCache


@dataclass(frozen=True)
class HeadRoute:
    """One head range of every layer, from this sender's cache to one receiver."""

    host: str
    port: int
    src: int  # first head of the range in the sender's cache
    count: int
    head_start: int  # its global index (travels on the frame; the receiver maps it into its own cache)


def routes(sends: list[tuple[int, Piece]], targets: list[tuple[str, int]]) -> list[HeadRoute]:
    """A prefill rank's routes from its part of a plan (`reshard.sends`) and each decode rank's address."""
    return [HeadRoute(*targets[rank], p.src_offset, p.count, p.head_start) for rank, p in sends]


def pieces_of(plan_for_rank: list[Piece]) -> tuple[tuple[int, int], ...]:
    """What a decode rank's `LoadSpec.pieces` must say: (first global head, count) of each range it gets."""
    return tuple((p.head_start, p.count) for p in plan_for_rank)


def slice_heads(k: torch.Tensor, v: torch.Tensor, scales: codec.Scales | None, src: int, count: int
                ) -> tuple[torch.Tensor, torch.Tensor, codec.Scales | None]:
    """Heads ``[src, src + count)`` of one save (``[tokens, heads, width]``, scales ``[tokens, heads]``):
    the tensors themselves when that is all of them (today's path, no copy), else contiguous copies."""
    heads = k.shape[1]
    if not 0 <= src < src + count <= heads:
        raise ValueError(f"head range [{src}, +{count}) outside the sender's {heads} heads")
    if (src, count) == (0, heads):
        return k, v, scales
    # a copy even when the range is already contiguous (one token): a view would share the export's memory,
    # which a NIXL sender keys by its first byte and frees once a route has taken it
    cut = [t[:, src:src + count].clone(memory_format=torch.contiguous_format) for t in (k, v, *(scales or ()))]
    return cut[0], cut[1], (cut[2], cut[3]) if scales is not None else None


Encode = Callable[[torch.Tensor, torch.Tensor, "codec.Scales | None", int], list[Frame]]


class Fanout:
    """Several outgoing transfers of one request (one per route) behind the one-transfer calls the
    connector makes: close, wait, abort, total_bytes, on_ack."""

    def __init__(self, routes: list[HeadRoute], boxes: list[Outbox]) -> None:
        self.routes, self.boxes = routes, boxes
        # memory the save was exported into, handed back when no route sends from it (every route a copy)
        self.release: Callable[[torch.Tensor], None] | None = None

    def frames(self, encode: Encode, k: torch.Tensor, v: torch.Tensor,
               scales: codec.Scales | None) -> list[tuple[Outbox, Frame]]:
        """Each route's frames of one save, with the outbox each goes to (encoder thread)."""
        out: list[tuple[Outbox, Frame]] = []
        used = False
        try:
            for route, box in zip(self.routes, self.boxes, strict=True):
                sk, sv, ss = slice_heads(k, v, scales, route.src, route.count)
                used = used or sk is k  # a route of all heads sends the export itself (it owns it from here)
                out += [(box, f) for f in encode(sk, sv, ss, route.head_start)]
        finally:
            if not used and self.release is not None:
                self.release(k)
        return out

    @property
    def total_bytes(self) -> int:
        return sum(b.total_bytes for b in self.boxes)

    @property
    def on_ack(self) -> Callable[[Frame], None] | None:
        return self.boxes[0].on_ack if self.boxes else None

    @on_ack.setter
    def on_ack(self, fn: Callable[[Frame], None] | None) -> None:
        for b in self.boxes:
            b.on_ack = fn

    def close(self) -> None:
        for b in self.boxes:
            b.close()

    async def wait(self) -> float:
        """Every route acknowledged: the slowest route's seconds. The first failure ends the wait (the
        caller aborts the rest)."""
        if not self.boxes:
            return 0.0
        tasks = [asyncio.ensure_future(b.wait()) for b in self.boxes]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            return max(t.result() for t in tasks)
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            for t in tasks:
                with contextlib.suppress(BaseException):
                    await t

    async def abort(self) -> None:
        await asyncio.gather(*(b.abort() for b in self.boxes), return_exceptions=True)


def write_heads(cache: PagedKVCache, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                head_offset: int, scales: codec.Scales | None = None) -> None:
    """Store a head range (as the wire carried it) into heads ``[head_offset, +k.shape[1])`` of ``slots`` of
    one layer of ``cache`` (the engine's ``kv_transfer.store_heads``: what every rank of a TP worker runs)."""
    store_heads(cache, layer, k, v, slots, head_offset, scales)
