"""What rank 0 tells the followers about each step, and how a follower rebuilds the batch from it.

The scheduler and block manager live on rank 0 only; a follower needs, per sequence, just what the model
runner reads: its length, where the new tokens start, those tokens, and its block table (block ids are the
same on every rank: each rank's cache has the same blocks, holding its own KV heads). Swap copies travel too,
so every rank moves the same blocks between its device and host caches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdcluster.worker.engine.sampling_params import SamplingParams
from pdcluster.worker.engine.scheduler import Batch
from pdcluster.worker.engine.sequence import Sequence

_PARAMS = SamplingParams()  # the runner never reads a follower's sampling parameters


@dataclass
class SeqStep:
    length: int  # tokens in the sequence after this step's new ones
    start: int  # tokens already in the cache
    tokens: list[int]  # the new tokens (prefill chunk, or the one decode token)
    block_table: list[int]


Targets = list[tuple[str, int]]  # each decode rank's KV transfer address, rank 0 first
Export = tuple[int, int, int, str, "Targets | None"]


@dataclass
class StepMsg:
    is_prefill: bool
    seqs: list[SeqStep]
    num_new_tokens: list[int]
    copies: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    num_decode: int = 0  # a mixed step's leading decode rows (scheduler.Batch)
    # KV export (prefill role), in the order rank 0's engine exports them at every layer: each exporting
    # request's (row, first token, end, request id, decode rank addresses). Addresses None: every rank gathers
    # its heads to rank 0 (kv_relay.py); else each rank sends its own heads there itself (the direct path)
    exports: list[Export] = field(default_factory=list)


@dataclass
class ImportMsg:
    """KV import (decode role), between steps: one received layer is coming, each rank's heads of it in a
    ``scatter`` that follows this message (kv_relay.py); every rank writes its own."""

    layer: int
    slots: Any  # torch.Tensor (int64, host): where the tokens go (the same on every rank)
    dtype: str  # of K and V as received (float values, or int8/uint8 codes)
    shape: tuple[int, int, int]  # one rank's K (and V): [tokens, its heads, width]
    quantized: bool  # float32 scales [tokens, its heads] follow K and V


def export_ranges(batch: Batch, direct: dict[str, Targets] | None = None) -> list[Export]:
    """(row, first token not yet sent, end, request id, targets) of the prefill-only rows that export KV this
    step: the same rows and order as the engine's ``_save_layer`` (llm_engine.py), which hands over only
    ``end > start``; targets are the request's decode rank addresses when it goes direct (``direct``)."""
    if not batch.is_prefill:
        return []
    direct = direct or {}
    return [(i, s.num_exported_tokens, s.num_computed_tokens + n, s.request_id, direct.get(s.request_id))
            for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True))
            if s.prefill_only and s.num_computed_tokens + n > s.num_exported_tokens]


def encode(batch: Batch) -> StepMsg:
    seqs = []
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        if batch.is_prefill:
            start = seq.num_computed_tokens
            seqs.append(SeqStep(len(seq), start, seq.token_ids[start : start + n], list(seq.block_table)))
        else:
            seqs.append(SeqStep(len(seq), len(seq) - 1, [seq.last_token_id], list(seq.block_table)))
    return StepMsg(batch.is_prefill, seqs, list(batch.num_new_tokens), list(batch.copies), batch.num_decode)


def decode(msg: StepMsg) -> Batch:
    """A Batch the ModelRunner runs exactly as rank 0's (token ids outside the new ones are never read)."""
    seqs = []
    for i, s in enumerate(msg.seqs):
        tail = s.length - s.start - len(s.tokens)
        seq = Sequence(f"tp-step-{i}", [0] * s.start + s.tokens + [0] * tail, _PARAMS)
        seq.num_computed_tokens = s.start
        seq.block_table = s.block_table
        seqs.append(seq)
    return Batch(seqs, msg.num_new_tokens, msg.is_prefill, msg.copies, msg.num_decode)
