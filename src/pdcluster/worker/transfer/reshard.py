"""KV re-sharding between tensor-parallel layouts: which prefill rank sends which KV heads to which decode
rank, when prefill runs at TP ``a`` and decode at TP ``b`` (pure: no torch, no sockets).

Both sides follow one rule for where a head lives (`pdcluster.worker.engine.parallel.heads`): contiguous
slices when ``kv_heads >= tp``, each head replicated on ``tp // kv_heads`` consecutive ranks otherwise. A
decode rank needs exactly the heads of its own slice; each is fetched once, from one prefill rank holding
it. When several prefill ranks hold a head (prefill replicates), the decode ranks that need it are dealt
round-robin over those holders, so the sending load spreads deterministically (both sides compute the same
plan, nothing is negotiated). Consecutive heads coming from one prefill rank travel as one piece: one head
range per (prefill rank, decode rank) pair and layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.worker.engine.parallel.heads import check_layout, kv_heads_of_rank, ranks_holding_head

# Bytes of one [head_dim] vector per wire format (int8/int4 codes carry one float32 scale each).
WIRE_FORMATS = ("f32", "f16", "bf16", "int8", "int4")


@dataclass(frozen=True)
class Piece:
    """One head range of every layer moving from one prefill rank to one decode rank."""

    src_rank: int  # prefill rank that sends it
    head_start: int  # global index of its first KV head (what travels on the wire)
    count: int  # heads in the range
    src_offset: int  # index of its first head in the prefill rank's cache
    dst_offset: int  # index of its first head in the decode rank's cache


def check_kv_layout(num_kv_heads: int, tp: int, side: str) -> None:
    """Raise ValueError, naming the side and layout, unless TP ``tp`` can shard ``num_kv_heads`` KV heads."""
    if num_kv_heads < 1:
        raise ValueError(f"{side} layout: KV head count must be >= 1, got {num_kv_heads}")
    try:
        # Only the KV-head conditions matter here: a query head count of kv_heads * tp always passes its own.
        check_layout(num_kv_heads, num_kv_heads * max(tp, 1), tp)
    except ValueError as e:
        raise ValueError(f"{side} TP {tp} with {num_kv_heads} KV heads is not a valid layout: {e}") from None


def plan(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> list[list[Piece]]:
    """For each decode rank, the pieces (in its cache order) that cover exactly the heads it owns."""
    check_kv_layout(num_kv_heads, prefill_tp, "prefill")
    check_kv_layout(num_kv_heads, decode_tp, "decode")
    out: list[list[Piece]] = []
    for rank in range(decode_tp):
        own = kv_heads_of_rank(num_kv_heads, decode_tp, rank)
        pieces: list[Piece] = []
        for head in own:
            holders = ranks_holding_head(num_kv_heads, prefill_tp, head)
            # this decode rank's position among the decode ranks needing `head` picks its holder
            src = holders[ranks_holding_head(num_kv_heads, decode_tp, head).index(rank) % len(holders)]
            last = pieces[-1] if pieces else None
            if last is not None and last.src_rank == src and last.head_start + last.count == head:
                pieces[-1] = Piece(src, last.head_start, last.count + 1, last.src_offset, last.dst_offset)
                continue
            src_first = kv_heads_of_rank(num_kv_heads, prefill_tp, src).start
            pieces.append(Piece(src, head, 1, head - src_first, head - own.start))
        out.append(pieces)
    return out


def sends(pieces: list[list[Piece]], prefill_rank: int) -> list[tuple[int, Piece]]:
    """What one prefill rank sends, per layer: (decode rank, piece), in decode rank order."""
    return [(rank, p) for rank, ps in enumerate(pieces) for p in ps if p.src_rank == prefill_rank]


def vector_bytes(head_dim: int, wire: str) -> int:
    """Wire bytes of one token's K (or V) for one head: values, or codes plus their float32 scale."""
    if wire not in WIRE_FORMATS:
        raise ValueError(f"wire format must be one of {WIRE_FORMATS}, got {wire!r}")
    if wire == "int4":
        return head_dim // 2 + 4
    return head_dim * {"f32": 4, "f16": 2, "bf16": 2, "int8": 1}[wire] + (4 if wire == "int8" else 0)


@dataclass(frozen=True)
class LayerBytes:
    """Bytes of one layer of ``tokens`` tokens moved by a plan (K and V, payload and scales, no framing)."""

    sent: tuple[int, ...]  # per prefill rank
    received: tuple[int, ...]  # per decode rank

    @property
    def total(self) -> int:
        return sum(self.received)


def layer_bytes(pieces: list[list[Piece]], prefill_tp: int, tokens: int, head_dim: int,
                wire: str = "f32") -> LayerBytes:
    per_head = 2 * tokens * vector_bytes(head_dim, wire)
    sent = [0] * prefill_tp
    received = []
    for ps in pieces:
        received.append(sum(p.count for p in ps) * per_head)
        for p in ps:
            sent[p.src_rank] += p.count * per_head
    return LayerBytes(tuple(sent), tuple(received))
