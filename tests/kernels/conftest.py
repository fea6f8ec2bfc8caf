"""Independent, obviously-correct oracles for the kernel tests.

Deliberately written without pdcluster.kernels code: walk each sequence token by token through its block
table, dequantize with plain arithmetic (own nibble unpacking), repeat KV heads for GQA, softmax in float64.
Slow and simple on purpose. Exposed as fixtures because --import-mode=importlib makes sibling imports awkward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch


def naive_dequant(codes: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache row(s) -> float64 [..., head_dim]. float: as is; int8: code * s; uint8: two nibbles per byte."""
    if scale is None:
        return codes.double()
    if codes.dtype == torch.int8:
        return codes.double() * scale.double().unsqueeze(-1)
    b = codes.to(torch.int64)
    vals = []
    for nib in (b % 16, b // 16):  # low nibble = even index
        vals.append(torch.where(nib >= 8, nib - 16, nib))
    full = torch.stack(vals, dim=-1).reshape(*codes.shape[:-1], codes.shape[-1] * 2)
    return full.double() * scale.double().unsqueeze(-1)


def naive_gather(cache: torch.Tensor, scale: torch.Tensor | None, table: list[int], length: int) -> torch.Tensor:
    """One sequence's first ``length`` tokens -> float64 [length, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    rows = []
    for t in range(length):
        blk, off = table[t // block_size], t % block_size
        rows.append(naive_dequant(cache[blk, off], None if scale is None else scale[blk, off]))
    return torch.stack(rows)


def naive_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=None, k_scale=None, v_scale=None):
    """float64 [seqs, heads, head_dim]; a seq_len of 0 gives zeros."""
    seqs, heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(seqs, heads, head_dim, dtype=torch.float64)
    for i in range(seqs):
        length = int(seq_lens[i])
        if length == 0:
            continue
        table = block_tables[i].tolist()
        k = naive_gather(k_cache, k_scale, table, length)
        v = naive_gather(v_cache, v_scale, table, length)
        group = heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)  # [L, heads, d]
        v = v.repeat_interleave(group, dim=1)
        for h in range(heads):
            s = (k[:, h, :] @ q[i, h].double()) * scale
            p = torch.softmax(s, dim=0)
            out[i, h] = p @ v[:, h, :]
    return out


@dataclass
class Paged:
    """A random paged cache plus the float K/V it was built from."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    k_float: list[torch.Tensor]  # per sequence [L, kv_heads, d] before quantization
    v_float: list[torch.Tensor]


def make_paged(seq_lens: list[int], kv_heads: int, head_dim: int, block_size: int, cache_dtype: torch.dtype,
               bits: int | None = None, seed: int = 0, extra_blocks: int = 3, pad_table: int = 1,
               transposed: bool = False) -> Paged:
    """Blocks are a random permutation of the pool (non-contiguous tables); table padding is -1.

    ``transposed`` stores the pool as [blocks, kv_heads, block_size, d] and permutes it, so the cache
    handed to the kernel has non-standard strides.
    """
    from pdcluster.kernels import quantize_kv  # quantizer is tested on its own; the oracle dequantizes

    g = torch.Generator().manual_seed(seed)
    nblk = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(nblk) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(nblk + [1]) + pad_table
    tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    last = head_dim if bits != 4 else head_dim // 2
    store_dtype = {None: cache_dtype, 8: torch.int8, 4: torch.uint8}[bits]
    if transposed:
        shape = (num_blocks, kv_heads, block_size, last)
        kc = torch.zeros(shape, dtype=store_dtype).permute(0, 2, 1, 3)
        vc = torch.zeros(shape, dtype=store_dtype).permute(0, 2, 1, 3)
    else:
        kc = torch.zeros(num_blocks, block_size, kv_heads, last, dtype=store_dtype)
        vc = torch.zeros_like(kc)
    ks = vs = None
    if bits is not None:
        # Random junk in unused scale slots: the kernels must never read them.
        ks = torch.rand(num_blocks, block_size, kv_heads, generator=g) * 1e3
        vs = torch.rand(num_blocks, block_size, kv_heads, generator=g) * 1e3
    kf, vf = [], []
    for i, n in enumerate(seq_lens):
        blocks = [perm.pop() for _ in range(nblk[i])]
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(n, kv_heads, head_dim, generator=g)
        v = torch.randn(n, kv_heads, head_dim, generator=g)
        kf.append(k)
        vf.append(v)
        for t in range(n):
            blk, off = blocks[t // block_size], t % block_size
            for cache, scale, x in ((kc, ks, k[t]), (vc, vs, v[t])):
                if bits is None:
                    cache[blk, off] = x.to(cache_dtype)
                else:
                    codes, s = quantize_kv(x.to(cache_dtype), bits=bits)
                    cache[blk, off] = codes
                    scale[blk, off] = s
    return Paged(kc, vc, ks, vs, tables, torch.tensor(seq_lens, dtype=torch.int32), kf, vf)


@pytest.fixture
def oracle() -> SimpleNamespace:
    return SimpleNamespace(
        attention=naive_attention, dequant=naive_dequant, gather=naive_gather, make_paged=make_paged
    )


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Deterministic inputs whatever the test order (tolerances were checked against these draws)."""
    torch.manual_seed(0)
