"""Tensors <-> LAYER frames, with optional int8 wire compression.

The receiver always gets float tensors `[num_tokens, kv_heads, head_dim]` back and imports them into
its own paged cache, so differing block sizes or cache dtypes (fp32 vs int8 cache) on the two sides are
the receiver's cache's business, not the wire's.
"""

from __future__ import annotations

import torch

from pdcluster.kernels.kv_quant import dequantize_kv, quantize_kv
from pdcluster.worker.transfer.frame import FLAG_INT8, DType, ErrorCode, Frame, FrameError, Kind

TORCH_OF = {DType.F32: torch.float32, DType.F16: torch.float16, DType.BF16: torch.bfloat16, DType.I8: torch.int8}
WIRE_OF = {v: k for k, v in TORCH_OF.items()}
COMPRESSIONS = ("none", "int8")


def _view(t: torch.Tensor) -> memoryview:
    """Flat byte view of a CPU tensor without copying (bf16 has no numpy dtype: reinterpret as int16)."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]  # ndarray implements the buffer protocol


def _raw(*ts: torch.Tensor) -> bytes:
    return b"".join(_view(t) for t in ts)  # one copy, however many tensors


def _from_raw(buf: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    view_as = torch.int16 if dtype == torch.bfloat16 else dtype
    # A frame received by the transport owns its (writable) receive buffer: the tensor is a view of it, no
    # copy. Anything read-only (a bytes object that may be shared) is copied: torch.frombuffer needs a
    # writable buffer, and nobody else's bytes may alias a tensor.
    writable = buf if isinstance(buf, memoryview) and not buf.readonly else bytearray(buf)
    t = torch.frombuffer(writable, dtype=view_as).reshape(shape)
    return t.view(dtype) if dtype == torch.bfloat16 else t


def encode_layer(
    request_id: str,
    layer: int,
    num_layers: int,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    compression: str = "none",
    token_start: int = 0,
) -> Frame:
    """Build one LAYER frame from K and V `[num_tokens, kv_heads, head_dim]` (CPU or GPU, any float dtype)."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"k and v must both be [tokens, kv_heads, head_dim], got {tuple(k.shape)}/{tuple(v.shape)}")
    tokens, heads, dim = k.shape
    common = dict(kind=Kind.LAYER, request_id=request_id, layer=layer, num_layers=num_layers,
                  token_start=token_start, token_end=token_start + tokens, kv_heads=heads, head_dim=dim)
    dtype, flags, payload, scales = wire_tensors(k, v, compression)
    return Frame(**common, dtype=dtype, flags=flags,  # type: ignore[arg-type]
                 scales=_raw(*scales) if scales else b"", payload=_raw(*payload))


def wire_tensors(k: torch.Tensor, v: torch.Tensor,
                 compression: str = "none") -> tuple[DType, int, list[torch.Tensor], list[torch.Tensor]]:
    """(dtype, flags, payload tensors, scale tensors) of one layer as the wire carries it: K then V codes (or
    values), then K then V float32 scales when int8. Shared by LAYER frames and NIXL staging."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    k, v = k.detach().cpu(), v.detach().cpu()
    if compression == "int8":
        qk, sk = quantize_kv(k, bits=8)
        qv, sv = quantize_kv(v, bits=8)
        return DType.I8, FLAG_INT8, [qk, qv], [sk, sv]
    if k.dtype not in WIRE_OF or k.dtype == torch.int8:
        k, v = k.float(), v.float()
    return WIRE_OF[k.dtype], 0, [k, v.to(k.dtype)], []


def decode_layer(frame: Frame, out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as `out_dtype` tensors `[num_tokens, kv_heads, head_dim]` (dequantized when int8)."""
    if frame.kind != Kind.LAYER:
        raise FrameError(ErrorCode.BAD_HEADER, "not a LAYER frame")
    shape = (frame.num_tokens, frame.kv_heads, frame.head_dim)
    half = len(frame.payload) // 2
    mv = memoryview(frame.payload)
    if frame.flags & FLAG_INT8:
        s_half = len(frame.scales) // 2  # scales: float32 [tokens, heads], K then V
        smv = memoryview(frame.scales)
        sk = _from_raw(smv[:s_half], torch.float32, shape[:2])
        sv = _from_raw(smv[s_half:], torch.float32, shape[:2])
        qk = _from_raw(mv[:half], torch.int8, shape)
        qv = _from_raw(mv[half:], torch.int8, shape)
        return dequantize_kv(qk, sk, 8, out_dtype), dequantize_kv(qv, sv, 8, out_dtype)
    dtype = TORCH_OF[frame.dtype]
    return _from_raw(mv[:half], dtype, shape).to(out_dtype), _from_raw(mv[half:], dtype, shape).to(out_dtype)
