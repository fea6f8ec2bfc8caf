"""pdcluster.kernels: paged decode attention and KV cache quantization (Triton kernels + torch paths).

Contract: the "Kernels" section of docs/architecture.md. Importing this package never imports triton.
The native C++ CPU kernels (`cpu/`) are reached through `pdcluster.kernels.native` only: their one entry and
their one switch, `PDCLUSTER_NATIVE_KERNELS`. The AOT compile check is `python -m pdcluster.kernels.compile_check`;
the kernel benchmark is benchmarks/kernels.py (outside the wheel).
"""

from pdcluster.kernels.cache import KV_DTYPES, allocate_kv_cache, kv_bits, kv_bytes_per_token
from pdcluster.kernels.dispatch import (
    BACKENDS,
    paged_decode_attention,
    resolve_backend,
    triton_available,
    write_kv_cache,
)
from pdcluster.kernels.kv_quant import dequantize_kv, pack_int4, quantize_kv, unpack_int4

__all__ = [
    "BACKENDS",
    "KV_DTYPES",
    "allocate_kv_cache",
    "dequantize_kv",
    "kv_bits",
    "kv_bytes_per_token",
    "pack_int4",
    "paged_decode_attention",
    "quantize_kv",
    "resolve_backend",
    "triton_available",
    "unpack_int4",
    "write_kv_cache",
]
