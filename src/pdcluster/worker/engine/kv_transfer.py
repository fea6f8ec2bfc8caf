"""KV of the paged cache in and out for disaggregation: received K/V (float values, or codes with their scales)
written into a layer or a head range of it, and the byte views of a request's slots that a transport sends
from or receives into. The engine's side of the protocol (export as layers are written; reserve, import,
commit or cancel) is LLMEngine's; the KV connector (kv_connector.py) is the boundary other code sees.
"""

from __future__ import annotations

import torch

from pdcluster.kernels import native, quantize_kv
from pdcluster.worker.engine.kv_cache import PagedKVCache


def store_layer(cache: PagedKVCache, layer: int, k: torch.Tensor, v: torch.Tensor,
                scales: tuple[torch.Tensor, torch.Tensor] | None, slots: torch.Tensor, dev: torch.device,
                dtype: torch.dtype) -> None:
    """Write received KV of ``slots`` into one layer of ``cache``: float K/V, or codes with their scales. Codes
    in the layer's own format go in as they are; anything else is converted (dequantized on the cache's
    device, quantized on write)."""
    slots = slots.to(dev)
    bits = {torch.int8: 8, torch.uint8: 4}.get(k.dtype)
    if bits is None:
        cache.write(layer, k.to(dev, dtype), v.to(dev, dtype), slots)
        return
    if scales is None:
        raise ValueError("KV codes need their scales")
    if bits == cache.layer_bits[layer]:
        cache.write_codes(layer, k, v, scales, slots)  # the sender's bytes, untouched
        return
    k, v = (native.dequantize(x.to(dev), s.to(dev), bits, dtype) for x, s in zip((k, v), scales, strict=True))
    cache.write(layer, k, v, slots)


def store_heads(cache: PagedKVCache, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                head_offset: int, scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Store a head range (as the wire carried it: float values, or codes with their scales) into heads
    ``[head_offset, +k.shape[1])`` of ``slots`` of one layer of ``cache``: codes of the layer's own format as
    they are; anything else converted (per-vector scales: quantizing a head range alone gives the codes
    quantizing the whole layer would). What each rank of a TP worker runs for the heads it receives itself."""
    n = k.shape[1]
    if not 0 <= head_offset <= head_offset + n <= cache.kv_heads:
        raise ValueError(f"heads [{head_offset}, +{n}) outside this cache's {cache.kv_heads}")
    bits, got = cache.layer_bits[layer], {torch.int8: 8, torch.uint8: 4}.get(k.dtype)
    if got is not None and scales is None:
        raise ValueError("KV codes need their scales")
    if got is not None and got != bits:
        assert scales is not None
        k, v = (native.dequantize(x, s, got, torch.float32) for x, s in zip((k, v), scales, strict=True))
        got, scales = None, None
    if bits is None:
        pairs = [(cache.k[layer], k), (cache.v[layer], v)]
    else:
        if got is None:
            (k, sk), (v, sv) = quantize_kv(k.float(), bits), quantize_kv(v.float(), bits)
            scales = (sk, sv)
        k_scale, v_scale = cache.k_scale[layer], cache.v_scale[layer]
        assert scales is not None and k_scale is not None and v_scale is not None
        pairs = [(cache.k[layer], k), (cache.v[layer], v), (k_scale, scales[0]), (v_scale, scales[1])]
    slots = slots.to(cache.device)
    for pool, new in pairs:
        flat = pool.view(-1, *pool.shape[2:])  # [slots, heads(, width)]
        flat.narrow(1, head_offset, n).index_copy_(0, slots, new.to(pool.device, pool.dtype))


def slot_views(cache: PagedKVCache, layer: int, slots: torch.Tensor) -> list[memoryview]:
    """Byte views of ``slots`` of one float layer, K then V, one view per run of consecutive slots (a run
    spans blocks that happen to be adjacent)."""
    breaks = (torch.nonzero(slots[1:] != slots[:-1] + 1).flatten() + 1).tolist()
    bounds = list(zip([0, *breaks], [*breaks, int(slots.numel())], strict=True))
    starts = slots.tolist()
    views = []
    for pool in (cache.k[layer], cache.v[layer]):
        if not pool.is_contiguous():
            raise ValueError("slot_views needs a contiguous pool (a reshape would copy)")
        flat = pool.view(-1, cache.kv_heads * cache.head_dim)
        arr = (flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat).numpy()
        views += [arr[starts[a]:starts[a] + b - a].data.cast("B") for a, b in bounds]
    return views


def hold_nothing() -> None:
    """The engine holds nothing for a placed receive: the reservation itself keeps the blocks."""
