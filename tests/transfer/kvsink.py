"""A test importer: what a connector delivers, kept as the receiver's cache would see it.

The connector hands the importer views of receive memory that is reused once it returns (a NIXL staging
region, a frame's buffer), one token range at a time; this copies each range out (as floats, dequantized
when it came as codes, and as the raw wire tensors) and joins a layer's ranges on lookup."""

from __future__ import annotations

from typing import Any

import torch

from pdcluster.worker.transfer import codec

Key = tuple[str, int]


class Sink:
    def __init__(self) -> None:
        self.parts: dict[Key, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.raw: list[tuple[Key, int, torch.Tensor, torch.Tensor, codec.Scales | None]] = []
        self.head_offsets: list[int] = []  # where each head range went in the receiver's cache (re-sharding)

    def __call__(self, rid: str, layer: int, k: torch.Tensor, v: torch.Tensor, *, token_start: int = 0,
                 scales: codec.Scales | None = None, head_offset: int = 0) -> None:
        self.head_offsets.append(head_offset)
        fk, fv = codec.to_float(k, v, scales)
        self.parts.setdefault((rid, layer), {})[token_start] = (fk.clone(), fv.clone())
        kept = (scales[0].clone(), scales[1].clone()) if scales is not None else None
        self.raw.append(((rid, layer), token_start, k.clone(), v.clone(), kept))

    def __getitem__(self, key: Key) -> tuple[torch.Tensor, torch.Tensor]:
        ranges = [self.parts[key][t] for t in sorted(self.parts[key])]
        return torch.cat([r[0] for r in ranges]), torch.cat([r[1] for r in ranges])

    def __contains__(self, key: Any) -> bool:
        return key in self.parts

    def __len__(self) -> int:
        return len(self.parts)

    def __bool__(self) -> bool:
        return bool(self.parts)
