"""The paged KV cache of one engine: per-layer block pools plus the few ways tokens get in and out.

Blocks hold ``block_size`` token slots; slot ``s`` is block ``s // block_size``, offset ``s % block_size``.
Storage and quantization formats come from ``pdcluster.kernels`` (float, int8, packed int4 + f32 scales), so
the decode kernel, the transfer path and this class all agree on one layout.
"""

from __future__ import annotations

import torch
from pdcluster.kernels import allocate_kv_cache, dequantize_kv, kv_bits, kv_bytes_per_token, write_kv_cache


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
    ) -> None:
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.kv_heads, self.head_dim, self.kv_dtype, self.dtype = kv_heads, head_dim, kv_dtype, dtype
        self.bits = kv_bits(kv_dtype)
        self.device = torch.device(device)
        layers = [
            allocate_kv_cache(num_blocks, block_size, kv_heads, head_dim, kv_dtype, dtype, device)
            for _ in range(num_layers)
        ]
        self.k = [layer[0] for layer in layers]
        self.v = [layer[1] for layer in layers]
        self.k_scale = [layer[2] for layer in layers]
        self.v_scale = [layer[3] for layer in layers]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, kv_heads: int, head_dim: int, kv_dtype: str, dtype: torch.dtype
    ) -> int:
        return block_size * kv_bytes_per_token(kv_heads, head_dim, kv_dtype, dtype, layers=num_layers)

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_block(
            self.num_layers, self.block_size, self.kv_heads, self.head_dim, self.kv_dtype, self.dtype
        )

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store k, v ``[n, kv_heads, head_dim]`` at ``slots`` (int64, all valid)."""
        if self.bits is None:
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
        for cache, scale in ((self.k[layer], self.k_scale[layer]), (self.v[layer], self.v_scale[layer])):
            x = cache[block_ids].flatten(0, 1)[:num_tokens]
            if self.bits is not None:
                assert scale is not None
                x = dequantize_kv(x, scale[block_ids].flatten(0, 1)[:num_tokens], self.bits, self.dtype)
            out.append(x)
        return out[0], out[1]

    def copy_blocks_to(self, dst: PagedKVCache, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        """Copy whole blocks (codes and scales as stored) into another pool of the same format: swap."""
        dst_ids = dst_ids.to(dst.device)
        for layer in range(self.num_layers):
            for s, d in (
                (self.k, dst.k),
                (self.v, dst.v),
                (self.k_scale, dst.k_scale),
                (self.v_scale, dst.v_scale),
            ):
                if s[layer] is not None:
                    d[layer].index_copy_(0, dst_ids, s[layer][src_ids.to(self.device)].to(dst.device))
