"""Sending a float layer straight from the sender's cache blocks: no export gather, no send buffer.

The engine may hand the TCP connector, instead of a gathered copy of a layer's token range, the byte views
where that range lies in its cache (`save_kv_views`: K's runs of consecutive slots, then V's, as
`kv_transfer.slot_views` gives them). Each LAYER frame's payload is then a `Gathered` of those views (cut at
token boundaries when the range is bigger than one frame): the GMAC tag is computed over them part by part and
`sendmsg` writes them to the socket where they lie. The wire and the tags are exactly those of a gathered
export, so the receiver cannot tell the two apart.

Why this is safe (what the engine's side guarantees, `LLMEngine._save_layer`):
- views are offered only for a request's last prefill chunk: once that step ends the request is PREFILLED
  and holds its blocks, untouched (no preemption, no later chunk writes them), until the worker releases it,
  which happens after `wait_for_save` returned (every frame ACKed) or after `abort_save` cancelled the
  outbox (no `sendmsg` runs after that);
- a resend after a reconnect reseals the same views, still held;
- only host memory in the wire's dtype qualifies (a device cache, a quantized layer or a head-sliced
  transfer keep the gather).

int8 compression of a float layer (`quantized_frames`) quantizes straight from the views, on the caller's
thread, into memory the frames own: no gather before the quantizer and no hop to an encoder thread. With the
native quantizer (~14 GB/s) that costs the engine's thread less than the gather it replaces (~10 GB/s); the
layers still overlap (layer n is on the wire while layer n+1 is computed and quantized).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from pdcluster.worker.transfer import codec
from pdcluster.worker.transfer.codec import WIRE_OF
from pdcluster.worker.transfer.frame import FLAG_QUANT, DType, Frame, Gathered, Kind


def cut(views: list[memoryview], lo: int, hi: int) -> list[memoryview]:
    """Bytes `[lo, hi)` of the concatenation of `views`, as views (no copy)."""
    out, pos = [], 0
    for v in views:
        end = pos + len(v)
        if end > lo and pos < hi:
            out.append(v[max(lo - pos, 0):min(hi, end) - pos])
        pos = end
        if pos >= hi:
            break
    return out


def view_frames(request_id: str, layer: int, num_layers: int, views: list[memoryview], *, token_start: int,
                num_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype, chunk_bytes: int,
                held: Callable[[], bool] | None = None) -> list[Frame]:
    """The LAYER frames of tokens `[token_start, +num_tokens)` of a float layer lying in `views` (K's bytes,
    then V's, in token order), each at most `chunk_bytes` of payload. Raises ValueError when the views do not
    hold exactly that range in `dtype`."""
    if dtype not in WIRE_OF or dtype in (torch.int8, torch.uint8):
        raise ValueError(f"views carry float values, not {dtype}")
    row = kv_heads * head_dim * dtype.itemsize  # one token's bytes of K (or of V)
    return [Frame(kind=Kind.LAYER, request_id=request_id, layer=layer, num_layers=num_layers,
                  token_start=token_start + s, token_end=token_start + e, kv_heads=kv_heads, head_dim=head_dim,
                  dtype=WIRE_OF[dtype], payload=Gathered(parts), held=held)
            for s, e, parts in runs(views, num_tokens, row, max(1, chunk_bytes // (2 * row)))]


def runs(views: list[memoryview], num_tokens: int, row: int, step: int
          ) -> Iterator[tuple[int, int, list[memoryview]]]:
    """Runs of `step` tokens: (start, end, K's bytes of the run then V's) of K and V of `num_tokens` tokens of
    `row` bytes each, lying in `views` (K's bytes, then V's). Raises ValueError when the sizes disagree."""
    views = [memoryview(v).cast("B") for v in views]
    if num_tokens <= 0 or row <= 0 or sum(len(v) for v in views) != 2 * num_tokens * row:
        raise ValueError(f"views hold {sum(len(v) for v in views)} bytes, not K and V of {num_tokens} tokens")
    half = num_tokens * row
    for s in range(0, num_tokens, step):
        e = min(num_tokens, s + step)
        yield s, e, cut(views, s * row, e * row) + cut(views, half + s * row, half + e * row)


def quantized_frames(request_id: str, layer: int, num_layers: int, views: list[memoryview], *, token_start: int,
                     num_tokens: int, kv_heads: int, head_dim: int, frame_bytes: int) -> list[Frame]:
    """LAYER frames of int8 codes and scales (`codec.quantize8`: the codes a gathered export would get) of
    tokens `[token_start, +num_tokens)` of an fp32 layer lying in `views` (K's bytes, then V's), at most
    `frame_bytes` on the wire each (the receiver dequantizes one while the next arrives). Each run is
    quantized where it lies; the frames hold the codes, nothing of `views`."""
    return [Frame(kind=Kind.LAYER, request_id=request_id, layer=layer, num_layers=num_layers,
                  token_start=token_start + s, token_end=token_start + e, kv_heads=kv_heads, head_dim=head_dim,
                  dtype=DType.I8, flags=FLAG_QUANT, scales=b"".join(codec.byte_view(sc) for _, sc in pieces),
                  payload=Gathered([codec.byte_view(q) for q, _ in pieces]))
            for s, e, pieces in quantized_runs(views, num_tokens, kv_heads, head_dim, frame_bytes)]


def quantized_runs(views: list[memoryview], num_tokens: int, kv_heads: int, head_dim: int, frame_bytes: int
                   ) -> Iterator[tuple[int, int, list[tuple[torch.Tensor, torch.Tensor]]]]:
    """Runs of tokens of an fp32 layer lying in `views` (K's bytes, then V's), each at most `frame_bytes` of
    int8 codes and scales: (start, end, (codes, scales) of each view piece of the run, K's then V's), each piece
    quantized where it lies (`codec.quantize8`), one run at a time as the caller asks for it."""
    if any(len(memoryview(v).cast("B")) % (head_dim * 4) for v in views):
        raise ValueError("views must hold whole vectors")
    step = max(1, frame_bytes // (2 * kv_heads * (head_dim + 4)))  # a token's codes and scales of K and V
    for s, e, parts in runs(views, num_tokens, kv_heads * head_dim * 4, step):
        yield s, e, [codec.quantize8(torch.frombuffer(v, dtype=torch.float32).view(-1, head_dim)) for v in parts]
