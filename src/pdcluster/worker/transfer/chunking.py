"""How one layer's token range is cut into LAYER frames, and when each frame can leave.

A layer that fits one frame goes whole (its payload a view of the export: no join). A bigger one goes in
token ranges of at most `chunk_bytes` on the wire. When the frames need computing (int8 compression of a
float layer: quantizing 64 MiB of fp32 takes longer on one core than sending it over loopback), ranges of at
most `pipe_bytes` on the wire are built one at a time, so the sender can write range k while the encoder
quantizes range k+1 and the receiver imports range k-1: the quantizer overlaps the I/O instead of
preceding it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from pdcluster.worker.transfer import codec
from pdcluster.worker.transfer.frame import Frame

PIPE_BYTES = 4 * 1024 * 1024  # wire bytes per frame while quantizing: 16 MiB of fp32 in, ~1 core-ms each


def token_step(k: torch.Tensor, quantizing: bool, quant: bool, limit: int) -> int:
    """Tokens per frame: wire bytes per token (K and V; codes add one f32 scale per head) into `limit`."""
    item = 1 if quantizing else k.element_size()
    per_token = 2 * k.shape[1] * (k.shape[2] * item + (4 if quant else 0))
    return max(1, limit // per_token)


def layer_frames(request_id: str, layer: int, num_layers: int, k: torch.Tensor, v: torch.Tensor, *,
                 offset: int = 0, scales: codec.Scales | None = None, head_start: int = 0,
                 compression: str = "none", chunk_bytes: int = 64 * 1024 * 1024,
                 pipe_bytes: int | None = None) -> Iterator[Frame]:
    """The frames of K and V `[tokens, kv_heads, head_dim]` for tokens `[offset, +tokens)`, built lazily
    (a consumer that sends each as it comes overlaps encoding with sending)."""
    tokens = k.shape[0]
    quantizing = scales is None and compression == "int8"
    limit = min(chunk_bytes, pipe_bytes or PIPE_BYTES) if quantizing else chunk_bytes
    step = token_step(k, quantizing, quantizing or scales is not None, limit)
    for s in range(0, tokens, step):
        whole = s == 0 and step >= tokens
        yield codec.encode_layer(
            request_id, layer, num_layers, k if whole else k[s:s + step], v if whole else v[s:s + step],
            compression=compression, token_start=offset + s, head_start=head_start,
            scales=scales if whole or scales is None else (scales[0][s:s + step], scales[1][s:s + step]))
