"""KV export and import of a tensor-parallel worker, relayed through rank 0: how a worker whose cache is
sharded by KV head across ranks still sends and receives whole layers over one transfer endpoint.

Export (prefill): inside the forward, right after a layer's KV is written, every rank gathers its own heads of
each exporting request's new token range into a host buffer and ``gather``s it to rank 0 (the step group,
gloo); rank 0 lays the heads out in global order (the first holder of a replicated head wins) in the layout a
single-rank cache exports — K, V, then K and V scales — so its KV connector sends exactly what a TP 1 worker
sends. Import (decode): between steps rank 0 broadcasts where a received layer goes (its slots) and
``scatter``s to each rank the heads that rank holds, which it writes (``kv_transfer.store_layer``). The wire and the router see no difference, so any
prefill layout pairs with any decode layout, over either transfer backend. The price is the gloo hop to and
from rank 0: the fallback now; by default each rank sends and receives its own heads on its own endpoint (the
direct path: server/tp_direct.py, transfer/reshard.py, head_slice.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pdcluster.worker.engine.kv_cache import PagedKVCache
from pdcluster.worker.engine.parallel import group
from pdcluster.worker.engine.parallel.heads import kv_heads_of_rank

Views = tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]
# KV bytes this process's rank 0 moved over the step group (followers' heads gathered for export, heads
# scattered to them on import): stays 0 while every request takes the direct path (tests read it)
RELAYED = {"gathered": 0, "scattered": 0}


def first_holders(num_kv_heads: int, tp: int) -> list[tuple[int, range]]:
    """(rank, its global heads) for the ranks whose heads together cover every head once, in head order."""
    out: list[tuple[int, range]] = []
    for rank in range(tp):
        heads = kv_heads_of_rank(num_kv_heads, tp, rank)
        if not out or heads.start >= out[-1][1].stop:  # a replica of the previous rank's head is skipped
            out.append((rank, heads))
    return out


def layer_views(buf: torch.Tensor, tokens: int, heads: int, dtype: torch.dtype, width: int,
                quantized: bool) -> Views:
    """Typed views of an export buffer laid out as ``PagedKVCache.export_into`` lays one out."""
    item = torch.empty(0, dtype=dtype).element_size()
    part = tokens * heads * width * item
    k, v = (buf[i * part:(i + 1) * part].view(dtype).view(tokens, heads, width) for i in range(2))
    if not quantized:
        return k, v, None
    s = tokens * heads * 4
    ks, vs = (buf[2 * part + i * s:2 * part + (i + 1) * s].view(torch.float32).view(tokens, heads)
              for i in range(2))
    return k, v, (ks, vs)


def export_own(cache: PagedKVCache, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """This rank's heads of ``slots`` of one layer, as stored, in a host buffer (what the gather carries)."""
    buf = torch.empty(cache.export_bytes(layer, int(slots.numel())), dtype=torch.uint8)
    cache.export_into(layer, slots, buf)
    return buf


def send_export(cache: PagedKVCache, layer: int, slots: torch.Tensor) -> None:
    """A follower's half of ``RelayedKV.export_into``: its heads to rank 0."""
    dist.gather(export_own(cache, layer, slots), None, dst=0, group=group.step_group())


class RelayedKV:
    """What rank 0's engine exports from under TP: the export calls of a ``PagedKVCache`` (export_bytes,
    export_into, is_quantized), but of every rank's heads. ``export_into`` is a collective: the followers run
    ``send_export`` for the same layer and token range at the same point of the same step."""

    def __init__(self, cache: PagedKVCache, num_kv_heads: int, tp: int) -> None:
        self.cache, self.num_kv_heads, self.tp = cache, num_kv_heads, tp

    def is_quantized(self, layer: int) -> bool:
        return self.cache.is_quantized(layer)

    def export_bytes(self, layer: int, tokens: int) -> int:
        return self.cache.export_bytes(layer, tokens) // self.cache.kv_heads * self.num_kv_heads

    def export_into(self, layer: int, slots: torch.Tensor, out: torch.Tensor) -> Views:
        n = int(slots.numel())
        if out.dtype != torch.uint8 or int(out.numel()) != self.export_bytes(layer, n):
            raise ValueError(f"export buffer must be {self.export_bytes(layer, n)} uint8 bytes")
        own = export_own(self.cache, layer, slots)
        parts = [torch.empty_like(own) for _ in range(self.tp)]
        dist.gather(own, parts, dst=0, group=group.step_group())
        RELAYED["gathered"] += sum(int(p.numel()) for p in parts[1:])
        dtype, width = self.cache.k[layer].dtype, int(self.cache.k[layer].shape[-1])
        quantized = self.cache.is_quantized(layer)
        whole = layer_views(out, n, self.num_kv_heads, dtype, width, quantized)
        for rank, heads in first_holders(self.num_kv_heads, self.tp):
            got = layer_views(parts[rank], n, self.cache.kv_heads, dtype, width, quantized)
            for dst, src in zip((whole[0], whole[1], *(whole[2] or ())), (got[0], got[1], *(got[2] or ())),
                                strict=True):
                dst[:, heads.start:heads.stop].copy_(src)
        return whole


def own_heads(k: torch.Tensor, v: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None,
              num_kv_heads: int, tp: int, rank: int
              ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """The heads rank ``rank`` holds, out of a whole layer as received (``[tokens, heads, ..]``)."""
    if k.shape[1] != num_kv_heads:
        raise ValueError(f"expected KV of all {num_kv_heads} heads, got {k.shape[1]}")
    h = kv_heads_of_rank(num_kv_heads, tp, rank)
    cut = [t[:, h.start:h.stop].contiguous() for t in (k, v, *(scales or ()))]
    return cut[0], cut[1], (cut[2], cut[3]) if scales is not None else None


def pack(k: torch.Tensor, v: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """K, V (and their scales) as one uint8 buffer in ``layer_views``'s layout (what the scatter carries)."""
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in (k, v, *(scales or ()))])


def scatter_parts(k: torch.Tensor, v: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None,
                  num_kv_heads: int, tp: int) -> list[torch.Tensor]:
    """Each rank's heads of a whole received layer, packed: rank 0's ``scatter`` list."""
    parts = [pack(*own_heads(k, v, scales, num_kv_heads, tp, rank)) for rank in range(tp)]
    RELAYED["scattered"] += sum(int(p.numel()) for p in parts[1:])
    return parts


def receive_part(shape: tuple[int, int, int], dtype: torch.dtype, quantized: bool) -> Views:
    """A follower's half of the import scatter: its heads of the layer, typed."""
    tokens, heads, width = shape
    item = torch.empty(0, dtype=dtype).element_size()
    buf = torch.empty(2 * tokens * heads * (width * item + (4 if quantized else 0)), dtype=torch.uint8)
    dist.scatter(buf, None, src=0, group=group.step_group())
    return layer_views(buf, tokens, heads, dtype, width, quantized)
