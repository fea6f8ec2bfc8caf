"""The paged KV cache of one engine: per-layer block pools plus the few ways tokens get in and out.

Blocks hold ``block_size`` token slots; slot ``s`` is block ``s // block_size``, offset ``s % block_size``.
Storage and quantization formats come from ``pdcluster.kernels`` (float, int8, packed int4 + f32 scales), so
the decode kernel, the transfer path and this class all agree on one layout.

Mixed precision: with an int8/int4 ``kv_dtype``, the layers in ``full_precision_layers`` keep a float cache
in the model dtype (no scales) and the rest are quantized. Every per-layer operation looks up its own layer's
format, so a block is a slot in every layer's pool but its bytes differ from layer to layer.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pdcluster.kernels import allocate_kv_cache, dequantize_kv, kv_bits, kv_bytes_per_token, write_kv_cache


def layer_kv_dtypes(
    num_layers: int, kv_dtype: str, full_precision_layers: Iterable[int] = ()
) -> tuple[str, ...]:
    """The KV dtype of each layer: ``kv_dtype``, except "auto" for the full-precision layers.

    Raises ValueError naming ``full_precision_layers`` for an index that is not a layer of the model. With
    ``kv_dtype == "auto"`` every layer is already full precision, so the list (once valid) changes nothing.
    """
    keep: set[int] = set()
    for i in full_precision_layers:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers:
            raise ValueError(
                f"full_precision_layers: {i!r} is not a layer index of this model "
                f"(it has {num_layers} layers: 0..{num_layers - 1})"
            )
        keep.add(i)
    return tuple("auto" if i in keep else kv_dtype for i in range(num_layers))


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        kv_dtype: str = "auto",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        full_precision_layers: Iterable[int] = (),
    ) -> None:
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.kv_heads, self.head_dim, self.kv_dtype, self.dtype = kv_heads, head_dim, kv_dtype, dtype
        self.layer_kv_dtypes = layer_kv_dtypes(num_layers, kv_dtype, full_precision_layers)
        # per layer: 8 / 4 for quantized pools, None for float pools (model dtype, no scales)
        self.layer_bits = [kv_bits(d) for d in self.layer_kv_dtypes]
        self.device = torch.device(device)
        layers = [
            allocate_kv_cache(num_blocks, block_size, kv_heads, head_dim, layer_dtype, dtype, device)
            for layer_dtype in self.layer_kv_dtypes
        ]
        self.k = [layer[0] for layer in layers]
        self.v = [layer[1] for layer in layers]
        self.k_scale = [layer[2] for layer in layers]
        self.v_scale = [layer[3] for layer in layers]

    @staticmethod
    def bytes_per_block(
        num_layers: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        kv_dtype: str,
        dtype: torch.dtype,
        full_precision_layers: Iterable[int] = (),
    ) -> int:
        """Bytes one block takes over all layers; each layer is sized in its own format."""
        dtypes = layer_kv_dtypes(num_layers, kv_dtype, full_precision_layers)
        return block_size * sum(kv_bytes_per_token(kv_heads, head_dim, d, dtype) for d in dtypes)

    @property
    def block_bytes(self) -> int:
        return self.block_size * sum(
            kv_bytes_per_token(self.kv_heads, self.head_dim, d, self.dtype) for d in self.layer_kv_dtypes
        )

    def is_quantized(self, layer: int) -> bool:
        return self.layer_bits[layer] is not None

    @property
    def has_float_layers(self) -> bool:
        return any(b is None for b in self.layer_bits)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store k, v ``[n, kv_heads, head_dim]`` at ``slots`` (int64, all valid)."""
        if self.layer_bits[layer] is None:
            # Float caches: a plain scatter. The engine builds slots itself, so the kernel entry point's
            # per-call validation (a host sync on CUDA) buys nothing in the per-layer hot path.
            self.k[layer].view(-1, self.kv_heads, self.head_dim).index_copy_(0, slots, k.to(self.dtype))
            self.v[layer].view(-1, self.kv_heads, self.head_dim).index_copy_(0, slots, v.to(self.dtype))
            return
        write_kv_cache(
            k,
            v,
            self.k[layer],
            self.v[layer],
            slots,
            k_scale=self.k_scale[layer],
            v_scale=self.v_scale[layer],
        )

    def read(self, layer: int, block_ids: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``num_tokens`` tokens stored in ``block_ids`` (in order), dequantized to the model dtype."""
        out = []
        bits = self.layer_bits[layer]
        for cache, scale in ((self.k[layer], self.k_scale[layer]), (self.v[layer], self.v_scale[layer])):
            x = cache[block_ids].flatten(0, 1)[:num_tokens]
            if bits is not None:
                assert scale is not None
                x = dequantize_kv(x, scale[block_ids].flatten(0, 1)[:num_tokens], bits, self.dtype)
            out.append(x)
        return out[0], out[1]

    # ---- KV export/import as stored (disaggregation): codes and scales travel untouched
    def _stored(self, layer: int) -> tuple[torch.dtype, int]:
        """(element dtype, elements per [head_dim] vector) of one layer's pool: packed int4 is half width."""
        return self.k[layer].dtype, int(self.k[layer].shape[-1])

    def export_bytes(self, layer: int, tokens: int) -> int:
        """Bytes of ``tokens`` tokens of one layer as stored: K then V values/codes, then K then V float32
        scales for a quantized layer (the wire's own order)."""
        dtype, width = self._stored(layer)
        vectors = tokens * self.kv_heads
        item = torch.empty(0, dtype=dtype).element_size()
        return 2 * vectors * width * item + (2 * vectors * 4 if self.is_quantized(layer) else 0)

    def export_into(self, layer: int, slots: torch.Tensor, out: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Copy the tokens at ``slots`` of one layer, as stored, into ``out`` (uint8, ``export_bytes`` long,
        host or device) laid out K, V, then K and V scales; returns typed views of ``out``. One gather is the
        only copy: nothing is dequantized, and K and V end up back to back (one wire payload)."""
        dtype, width = self._stored(layer)
        n = int(slots.numel())
        if out.dtype != torch.uint8 or out.dim() != 1 or int(out.numel()) != self.export_bytes(layer, n):
            raise ValueError(f"export buffer must be {self.export_bytes(layer, n)} uint8 bytes")
        item = torch.empty(0, dtype=dtype).element_size()
        part = n * self.kv_heads * width * item
        views = [out[i * part:(i + 1) * part].view(dtype).view(n, self.kv_heads, width) for i in range(2)]
        pools = [self.k[layer], self.v[layer]]
        if self.is_quantized(layer):
            s_part = n * self.kv_heads * 4
            views += [out[2 * part + i * s_part:2 * part + (i + 1) * s_part].view(torch.float32).view(n, self.kv_heads)
                      for i in range(2)]
            k_scale, v_scale = self.k_scale[layer], self.v_scale[layer]
            assert k_scale is not None and v_scale is not None  # a quantized layer has its scales
            pools += [k_scale, v_scale]
        slots = slots.to(self.device)
        for pool, dst in zip(pools, views, strict=True):
            flat = pool.view(-1, *pool.shape[2:])
            if dst.device == flat.device:
                torch.index_select(flat, 0, slots, out=dst)
            else:  # e.g. a CUDA cache exporting into host memory: gather on the device, one copy across
                dst.copy_(flat.index_select(0, slots))
        scales = (views[2], views[3]) if len(views) == 4 else None
        return views[0], views[1], scales

    def write_codes(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                    scales: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor) -> None:
        """Store codes and scales exactly as given, in this layer's own format (what another cache of the same
        format exported): no dequantize, no requantize."""
        dtype, width = self._stored(layer)
        if not self.is_quantized(layer) or k.dtype != dtype or v.dtype != dtype or k.shape[-1] != width:
            raise ValueError(f"layer {layer} stores {self.layer_kv_dtypes[layer]} ({dtype}, {width} per vector); "
                             f"got {k.dtype} [.., {k.shape[-1]}]")
        for pool, new in ((self.k[layer], k), (self.v[layer], v), (self.k_scale[layer], scales[0]),
                          (self.v_scale[layer], scales[1])):
            assert pool is not None
            pool.view(-1, *pool.shape[2:]).index_copy_(0, slots, new.to(self.device, pool.dtype))

    def copy_blocks_to(self, dst: PagedKVCache, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        """Copy whole blocks (codes and scales as stored) into another pool of the same format: swap."""
        # Raw copies are only meaningful between pools with the same per-layer formats (device <-> host).
        assert dst.layer_kv_dtypes == self.layer_kv_dtypes and dst.dtype == self.dtype
        dst_ids = dst_ids.to(dst.device)
        for layer in range(self.num_layers):
            for s, d in (
                (self.k, dst.k),
                (self.v, dst.v),
                (self.k_scale, dst.k_scale),
                (self.v_scale, dst.v_scale),
            ):
                src_pool, dst_pool = s[layer], d[layer]
                if src_pool is not None:
                    assert dst_pool is not None  # the same per-layer formats: the same pools exist
                    dst_pool.index_copy_(0, dst_ids, src_pool[src_ids.to(self.device)].to(dst.device))
