"""Tensors <-> LAYER frames: float K/V, int8 wire compression, or a quantized cache's own codes.

What travels is what the sender's cache holds, as far as it can: a layer stored as int8/int4 codes ships
those codes and their float32 scales untouched (never dequantized to float and quantized again); a float
layer ships as floats, or as int8 codes + scales with `--kv-transfer-compression int8`. The receiver gets
the wire tensors back as zero-copy views of the frame's buffer (`wire_kv`) and its engine writes them into
its own paged cache: codes straight in when its layer has the same format, dequantized otherwise, so
differing block sizes or cache dtypes on the two sides stay the receiver's business.

No join on the send path: when K and V (and their scales) lie back to back in one buffer, as the engine's
export lays them out, the payload is a view of that buffer (`_raw`); only unrelated tensors are joined.
"""

from __future__ import annotations

import torch

from pdcluster.kernels import native
from pdcluster.kernels.kv_quant import QMAX, quantize_kv
from pdcluster.worker.transfer import options as transfer_options
from pdcluster.worker.transfer.frame import (
    FLAG_QUANT,
    DType,
    ErrorCode,
    Frame,
    FrameError,
    Gathered,
    Kind,
    vector_bytes,
)

TORCH_OF = {DType.F32: torch.float32, DType.F16: torch.float16, DType.BF16: torch.bfloat16, DType.I8: torch.int8,
            DType.I4: torch.uint8}
WIRE_OF = {v: k for k, v in TORCH_OF.items()}
BITS_OF = {torch.int8: 8, torch.uint8: 4}  # code dtype -> bits (uint8 = int4 packed two per byte)
COMPRESSIONS = transfer_options.COMPRESSIONS  # declared with --kv-transfer-compression
Scales = tuple[torch.Tensor, torch.Tensor]


def code_bits(t: torch.Tensor) -> int | None:
    """8 or 4 when `t` holds cache codes (int8, or uint8 packed int4), None for float values."""
    return BITS_OF.get(t.dtype)


def byte_view(t: torch.Tensor) -> memoryview:
    """Flat byte view of a CPU tensor without copying (bf16 has no numpy dtype: reinterpret as int16)."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().data.cast("B")


def adjacent(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """One flat uint8 tensor spanning `ts` when they are contiguous CPU tensors lying back to back in one
    storage (K then V of the engine's export): their bytes as a single view, no copy. Else None."""
    if not ts or any(not t.is_contiguous() or t.device.type != "cpu" for t in ts):
        return None
    storage = ts[0].untyped_storage()
    start = end = ts[0].data_ptr()
    for t in ts:
        if t.untyped_storage().data_ptr() != storage.data_ptr() or t.data_ptr() != end:
            return None
        end += t.numel() * t.element_size()
    offset = start - storage.data_ptr()
    return torch.empty(0, dtype=torch.uint8).set_(storage, offset, (end - start,), (1,))


GATHER_MIN = 1 << 16  # below this a join costs less than another part to tag and write


def _raw(*ts: torch.Tensor) -> memoryview | bytes:
    """The tensors' bytes in order: a view when they already lie back to back, else one joined copy."""
    ts = tuple(t.detach().cpu() for t in ts)
    span = adjacent(list(ts))
    if span is not None:
        return byte_view(span)
    return b"".join(byte_view(t) for t in ts)


def _payload(*ts: torch.Tensor) -> memoryview | bytes | Gathered:
    """As `_raw`, but big tensors that do not lie back to back stay views, the parts of one payload (e.g. K
    and V of one token range of a bigger export)."""
    ts = tuple(t.detach().cpu() for t in ts)
    if adjacent(list(ts)) is None and sum(t.numel() * t.element_size() for t in ts) >= GATHER_MIN:
        return Gathered([byte_view(t) for t in ts])
    return _raw(*ts)


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
    scales: Scales | None = None,
    head_start: int = 0,
) -> Frame:
    """Build one LAYER frame from K and V `[num_tokens, kv_heads, head_dim]` (CPU or GPU, any float dtype), or
    from cache codes (int8 `[.., head_dim]`, uint8 packed int4 `[.., head_dim // 2]`) with their `scales`.
    `head_start`: the global index of the first of these KV heads (a head range of a re-sharded transfer)."""
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"k and v must both be [tokens, kv_heads, head_dim], got {tuple(k.shape)}/{tuple(v.shape)}")
    tokens, heads, width = k.shape
    dim = width * 2 if code_bits(k) == 4 else width
    dtype, flags, payload, wire_scales = wire_tensors(k, v, compression, scales)
    return Frame(kind=Kind.LAYER, request_id=request_id, layer=layer, num_layers=num_layers,
                 token_start=token_start, token_end=token_start + tokens, kv_heads=heads, head_dim=dim,
                 head_start=head_start, dtype=dtype, flags=flags,
                 scales=_raw(*wire_scales) if wire_scales else b"", payload=_payload(*payload))


def wire_tensors(k: torch.Tensor, v: torch.Tensor, compression: str = "none",
                 scales: Scales | None = None) -> tuple[DType, int, list[torch.Tensor], list[torch.Tensor]]:
    """(dtype, flags, payload tensors, scale tensors) of one layer as the wire carries it: K then V codes (or
    values), then K then V float32 scales when quantized. Codes given with `scales` go as they are, whatever
    `compression` says (they are the cache's own bytes: shipping them loses nothing). Shared by LAYER frames
    and NIXL staging."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    bits = code_bits(k)
    if bits is not None or scales is not None:
        if scales is None or code_bits(v) != bits or bits is None:
            raise ValueError("cache codes need int8 or uint8 (int4) K and V of one dtype, with their scales")
        sk, sv = (s.detach().cpu().float() for s in scales)
        if sk.shape != k.shape[:2] or sv.shape != v.shape[:2]:
            raise ValueError(f"scales must be [tokens, kv_heads], got {tuple(sk.shape)}/{tuple(sv.shape)}")
        return WIRE_OF[k.dtype], FLAG_QUANT, [k.detach().cpu(), v.detach().cpu()], [sk, sv]
    k, v = k.detach().cpu(), v.detach().cpu()
    if compression == "int8":
        both = adjacent([k, v]) if k.dtype == v.dtype else None
        if both is not None:  # one pass over K and V together: codes and scales come out back to back
            q, s = quantize8(both.view(k.dtype).view(2 * k.shape[0], *k.shape[1:]))
            return DType.I8, FLAG_QUANT, [q], [s]
        qk, sk = quantize8(k)
        qv, sv = quantize8(v)
        return DType.I8, FLAG_QUANT, [qk, qv], [sk, sv]
    if k.dtype not in WIRE_OF or code_bits(k) is not None:
        k, v = k.float(), v.float()
    return WIRE_OF[k.dtype], 0, [k, v.to(k.dtype)], []


QUANT_ROWS = 1024  # vectors per slice: 512 KiB of fp32 at head_dim 128, within a core's L2


def quantize8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.kv_quant.quantize_kv(x, bits=8)`, bit for bit, at ~2x its speed on a CPU: a slice of vectors
    at a time through one scratch buffer that stays in cache (the kernel's version makes five passes over
    fresh full-size temporaries, which is what int8 compression on the wire cost), and absmax from one
    aminmax pass instead of abs then amax. Other devices and dtypes go to the kernel."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() < 1 or not x.shape[-1]:
        return quantize_kv(x, bits=8)
    fast = native.quantize8(x)  # the AVX-512 kernel, same bits, one pass per vector
    if fast is not None:
        return fast
    dim = x.shape[-1]
    flat = x.reshape(-1, dim)
    rows = flat.shape[0]
    codes = torch.empty(rows, dim, dtype=torch.int8)
    scales = torch.empty(rows, dtype=torch.float32)
    scratch = torch.empty(min(QUANT_ROWS, rows), dim)
    for r in range(0, rows, QUANT_ROWS):
        xs, sc = flat[r:r + QUANT_ROWS], scales[r:r + QUANT_ROWS]
        lo, hi = torch.aminmax(xs, dim=-1)
        torch.maximum(hi, lo.neg_(), out=sc)
        sc.abs_().div_(QMAX[8])  # abs_: an all-zero vector's max(0, -0) may be -0; the kernel's absmax is +0
        safe = torch.where(sc > 0, sc, 1.0).unsqueeze(-1)
        buf = scratch[:xs.shape[0]]
        torch.div(xs, safe, out=buf)
        codes[r:r + QUANT_ROWS].copy_(buf.round_().clamp_(-QMAX[8], QMAX[8]))
    return codes.view(x.shape), scales.view(x.shape[:-1])


def wire_kv(frame: Frame) -> tuple[torch.Tensor, torch.Tensor, Scales | None]:
    """K and V of a LAYER frame as the wire carries them, zero-copy views of its buffer: float values
    `[tokens, kv_heads, head_dim]`, or codes (int8, uint8 packed int4) plus their float32 scales."""
    if frame.kind != Kind.LAYER:
        raise FrameError(ErrorCode.BAD_HEADER, "not a LAYER frame")
    dtype = TORCH_OF[frame.dtype]
    width = vector_bytes(frame.dtype, frame.head_dim) // dtype.itemsize
    shape = (frame.num_tokens, frame.kv_heads, width)
    half = len(frame.payload) // 2
    # a frame built here and never sent (tests, in-process use) may hold its payload in parts: join them
    mv = memoryview(bytes(frame.payload) if isinstance(frame.payload, Gathered) else frame.payload)
    k, v = _from_raw(mv[:half], dtype, shape), _from_raw(mv[half:], dtype, shape)
    if not frame.flags & FLAG_QUANT:
        return k, v, None
    s_half = len(frame.scales) // 2  # scales: float32 [tokens, heads], K then V
    smv = memoryview(frame.scales)
    return k, v, (_from_raw(smv[:s_half], torch.float32, shape[:2]), _from_raw(smv[s_half:], torch.float32, shape[:2]))


def to_float(k: torch.Tensor, v: torch.Tensor, scales: Scales | None,
             out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Wire tensors as `out_dtype` values (dequantized when they are codes)."""
    bits = code_bits(k)
    if bits is None:
        return k.to(out_dtype), v.to(out_dtype)
    if scales is None:
        raise ValueError("codes without scales")
    return native.dequantize(k, scales[0], bits, out_dtype), native.dequantize(v, scales[1], bits, out_dtype)


def decode_layer(frame: Frame, out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as `out_dtype` tensors `[num_tokens, kv_heads, head_dim]` (dequantized when quantized)."""
    return to_float(*wire_kv(frame), out_dtype=out_dtype)
