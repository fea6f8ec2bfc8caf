"""Symmetric per-vector KV quantization (torch path; also the oracle for the fused Triton dequant).

One float32 scale per vector over the last dim: ``scale = absmax / qmax`` with ``qmax = 127`` for int8 and
``7`` for int4, ``q = round(x / scale)`` (round half to even, as ``torch.round``). int4 values are packed two
per byte into uint8, low nibble = even index, each nibble a two's-complement 4-bit integer in [-7, 7].
These are the same formats the paged caches hold, and what KV transfer uses for compression.
"""

from __future__ import annotations

import torch

QMAX: dict[int, int] = {8: 127, 4: 7}

# Adding then subtracting 1.5 * 2**23 rounds an fp32 value with |y| < 2**22 to the nearest integer (ties to
# even) using only IEEE adds. The Triton kernels use this trick because the interpreter lacks libdevice.rint;
# it gives exactly torch.round's answer, so both paths produce identical codes.
ROUND_MAGIC = 12582912.0


def _check_bits(bits: int) -> int:
    if bits not in QMAX:
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    return QMAX[bits]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack int values in [-8, 7] (last dim even) into uint8, low nibble = even index."""
    if q.shape[-1] % 2:
        raise ValueError(f"q: last dim must be even to pack int4, got {q.shape[-1]}")
    nib = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return nib[..., 0::2] | (nib[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: uint8 [..., d // 2] -> int8 [..., d] (sign-extended nibbles)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"q: packed int4 must be uint8, got {packed.dtype}")
    b = packed.to(torch.int16)
    lo = b & 0xF
    hi = (b >> 4) & 0xF
    # Sign-extend: nibbles 8..15 are -8..-1.
    lo = lo - ((lo & 8) << 1)
    hi = hi - ((hi & 8) << 1)
    return torch.stack((lo, hi), dim=-1).flatten(-2).to(torch.int8)


_NIBBLE_LUT: dict[torch.device, torch.Tensor] = {}


def _nibble_lut(device: torch.device) -> torch.Tensor:
    """float32 [256, 2]: byte -> (low, high) signed nibble values; one gather replaces ~8 bitwise passes."""
    lut = _NIBBLE_LUT.get(device)
    if lut is None:
        lut = unpack_int4(torch.arange(256, dtype=torch.int32).to(torch.uint8).unsqueeze(-1)).to(torch.float32)
        lut = _NIBBLE_LUT[device] = lut.to(device)
    return lut


def quantize_kv(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., d]`` to (int8 ``[..., d]`` or packed uint8 ``[..., d // 2]``, float32 scale ``[...]``).

    All-zero vectors get scale 0 and codes 0 (no NaN/inf). Non-finite inputs are not supported.
    """
    qmax = _check_bits(bits)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"x: must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x: needs a non-empty last dim, got shape {tuple(x.shape)}")
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=-1) / qmax
    # A zero scale (all-zero vector, or absmax so small the scale underflows) divides by 1 instead: codes 0.
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / safe.unsqueeze(-1)).clamp_(-qmax, qmax)
    if bits == 8:
        return q.to(torch.int8), scale
    return pack_int4(q.to(torch.int8)), scale


def dequantize_kv(
    q: torch.Tensor, scale: torch.Tensor, bits: int = 8, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of quantize_kv: codes times per-vector scale, returned in ``dtype``."""
    _check_bits(bits)
    if bits == 8 and q.dtype != torch.int8:
        raise ValueError(f"q: int8 codes expected for bits=8, got {q.dtype}")
    if bits == 4 and q.dtype != torch.uint8:
        raise ValueError(f"q: packed uint8 codes expected for bits=4, got {q.dtype}")
    if scale.shape != q.shape[:-1]:
        raise ValueError(f"scale: shape {tuple(scale.shape)} must equal q.shape[:-1] {tuple(q.shape[:-1])}")
    if bits == 8:
        values = q.to(torch.float32)
    else:
        flat = _nibble_lut(q.device).index_select(0, q.reshape(-1).to(torch.int32))
        values = flat.view(*q.shape[:-1], q.shape[-1] * 2)
    return (values * scale.to(torch.float32).unsqueeze(-1)).to(dtype)
