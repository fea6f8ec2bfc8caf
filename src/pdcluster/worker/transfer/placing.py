"""Receiving a float layer straight into the decode side's cache (no receive buffer, no import copy).

The receiver's owner may give the TCP connector a `Destination`: for a request being imported, the memory of
tokens `[token_start, +num_tokens)` of one layer in its cache, as byte views in wire order (K's tokens, then
V's), when the cache stores exactly what the wire carries (same dtype, host memory). A data frame for such a
range is then received into those views (`channel.read_placed`) and checked with its tags over them.

Why this is safe:
- the header is authenticated before anything is placed; the payload's tag is checked over the bytes where
  they landed; a frame that fails it fails the load (the request never decodes from those blocks);
- only ranges not yet imported are placed (a resend of an imported range goes to a pool buffer and is
  dropped), so a finished layer is never written again;
- bytes land only inside `recvmsg_into` calls on the event loop, and each call first checks that the load is
  still the one placed for (`alive`): once `cancel_load` has run (on that loop, before the owner frees the
  request's blocks), nothing more is written into them, and the connection is dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from pdcluster.worker.transfer.channel import Placement
from pdcluster.worker.transfer.codec import TORCH_OF
from pdcluster.worker.transfer.frame import FLAG_QUANT, Header

# (request_id, layer, token_start, num_tokens, wire dtype) -> (views of the payload's bytes in wire order, a
# callback for when the receive into them has ended), or None: receive into a buffer and import as before
Destination = Callable[[str, int, int, int, torch.dtype], tuple[list[memoryview], Callable[[], None]] | None]


class Shaped(Protocol):
    """What `fits` reads of a frame or a header (both frozen: read-only here)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def token_end(self) -> int: ...
    @property
    def head_start(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...


def fits(spec: Any, f: Shaped) -> bool:
    """A data frame (or its header) matches the load it names (layers, head_dim, tokens, head range)."""
    return (f.num_layers, f.head_dim) == (spec.num_layers, spec.head_dim) and f.token_end <= spec.num_tokens \
        and (f.head_start, f.kv_heads) in (spec.pieces or ((spec.head_offset, spec.kv_heads),))


def claim(load: Any, hdr: Header, request_id: str, destination: Destination,
          alive: Callable[[], bool]) -> Placement | None:
    """The destination of a float LAYER frame for `load` (connector._Load), with its range marked as being
    imported; None when it is not placeable (quantized, a head range, a resend, a mismatch: the normal path
    handles and reports those)."""
    if load is None or load.error or hdr.flags & FLAG_QUANT or load.spec.pieces or not fits(load.spec, hdr):
        return None
    key = (hdr.token_start, hdr.head_start)
    if hdr.layer in load.loaded or key in load.ranges.get(hdr.layer, {}):
        return None
    got = destination(request_id, hdr.layer, hdr.token_start, hdr.token_end - hdr.token_start, TORCH_OF[hdr.dtype])
    if got is None:
        return None
    views, release = got
    if sum(len(v) for v in views) != hdr.payload_len:
        release()
        return None
    load.ranges.setdefault(hdr.layer, {})[key] = 0  # being imported: a duplicate is not placed over it

    def abandon(fatal: bool) -> None:
        release()
        load.ranges.get(hdr.layer, {}).pop(key, None)  # a resend (new connection) may place it again
        if fatal and not load.error:
            load.error = f"layer {hdr.layer} tokens [{hdr.token_start}, {hdr.token_end}) failed its tag"
            load.changed.set()

    return Placement(views, abandon, alive, release)
