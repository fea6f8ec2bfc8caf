"""What a transfer is about, shared by the connectors: where a save goes (`TransferTarget`), what it took
(`SaveResult`), what a load expects (`LoadSpec`), and a receiver's state per load and per received frame."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdcluster.worker.transfer import codec


@dataclass(frozen=True)
class TransferTarget:
    host: str
    port: int


@dataclass(frozen=True)
class SaveResult:
    seconds: float  # first frame queued -> last ACK received
    bytes: int  # on the wire, frames included (resends not counted twice)


@dataclass(frozen=True)
class LoadSpec:
    """What the consumer expects for one request; frames that disagree are refused (SHAPE_MISMATCH)."""

    request_id: str
    num_layers: int
    num_tokens: int
    kv_heads: int  # of this receiver's cache
    head_dim: int
    # TP re-sharding (head_slice.py): the global index of this cache's first head, and the (first global
    # head, count) ranges each layer arrives in; () = one range of all kv_heads from head_offset (today)
    head_offset: int = 0
    pieces: tuple[tuple[int, int], ...] = ()


@dataclass
class Received:
    """One data frame's KV as received (views of receive memory) and how to give that memory back."""

    k: torch.Tensor
    v: torch.Tensor
    scales: codec.Scales | None
    nbytes: int
    release: Callable[[], None] = lambda: None
    placed: bool = False  # already in the cache (a NIXL READ into its blocks): nothing to import


@dataclass
class _Load:
    spec: LoadSpec
    started: float = field(default_factory=time.monotonic)
    # layer -> (token_start, head_start) -> token-heads imported (0 while that range is being imported):
    # each range is written into the cache as it arrives, never held back to be joined with the others
    ranges: dict[int, dict[tuple[int, int], int]] = field(default_factory=dict)
    loaded: set[int] = field(default_factory=set)
    error: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    bytes: int = 0
