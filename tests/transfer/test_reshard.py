"""The re-sharding plan between tensor-parallel layouts: every decode rank gets exactly its heads, each once,
from a prefill rank that holds them, with the load of replicated heads spread; bytes per rank per layer."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from pdcluster.worker.engine.parallel.heads import kv_heads_of_rank, ranks_holding_head
from pdcluster.worker.transfer.reshard import Piece, layer_bytes, plan, sends, vector_bytes


def valid(heads: int, tp: int) -> bool:
    return heads % tp == 0 if heads >= tp else tp % heads == 0


COMBOS = [(h, a, b) for h, a, b in itertools.product([1, 2, 3, 4, 6, 8, 16], [1, 2, 3, 4, 6, 8, 16], [1, 2, 3, 4, 6, 8, 16])
          if valid(h, a) and valid(h, b)]


@pytest.mark.parametrize(("heads", "a", "b"), COMBOS)
def test_every_decode_rank_gets_exactly_its_heads_once(heads: int, a: int, b: int) -> None:
    pieces = plan(heads, a, b)
    assert len(pieces) == b
    for rank, ps in enumerate(pieces):
        got = [h for p in ps for h in range(p.head_start, p.head_start + p.count)]
        assert got == list(kv_heads_of_rank(heads, b, rank))  # all of them, once each, in cache order
        assert [p.dst_offset for p in ps] == list(itertools.accumulate([0] + [p.count for p in ps[:-1]]))
        for p in ps:
            src = kv_heads_of_rank(heads, a, p.src_rank)
            assert p.head_start in src and p.head_start + p.count - 1 in src  # the sender holds the whole range
            assert p.src_offset == p.head_start - src.start and p.count >= 1
        assert len({p.src_rank for p in ps}) == len(ps)  # one piece per (prefill rank, decode rank) pair


@pytest.mark.parametrize(("heads", "a", "b"), COMBOS)
def test_replicated_heads_spread_the_sending_load(heads: int, a: int, b: int) -> None:
    pieces = plan(heads, a, b)
    for head in range(heads):
        senders = Counter(p.src_rank for ps in pieces for p in ps if p.head_start <= head < p.head_start + p.count)
        holders = ranks_holding_head(heads, a, head)
        counts = [senders.get(r, 0) for r in holders]
        assert sum(counts) == len(ranks_holding_head(heads, b, head))  # one fetch per decode rank holding it
        assert max(counts) - min(counts) <= 1, (head, counts)
    assert plan(heads, a, b) == pieces  # deterministic


@pytest.mark.parametrize(("heads", "tp"), [(8, 1), (8, 2), (8, 8), (2, 4), (1, 4), (4, 8)])
def test_same_layout_is_each_rank_to_itself(heads: int, tp: int) -> None:
    pieces = plan(heads, tp, tp)
    for rank, ps in enumerate(pieces):
        own = kv_heads_of_rank(heads, tp, rank)
        assert ps == [Piece(rank, own.start, len(own), 0, 0)]


def test_named_layouts() -> None:
    assert plan(4, 2, 1) == [[Piece(0, 0, 2, 0, 0), Piece(1, 2, 2, 0, 2)]]  # 2 -> 1: both halves to one rank
    assert plan(4, 1, 2) == [[Piece(0, 0, 2, 0, 0)], [Piece(0, 2, 2, 2, 0)]]  # 1 -> 2: rank 0 splits
    assert plan(4, 2, 4) == [[Piece(0, 0, 1, 0, 0)], [Piece(0, 1, 1, 1, 0)], [Piece(1, 2, 1, 0, 0)],
                             [Piece(1, 3, 1, 1, 0)]]
    assert plan(4, 4, 2) == [[Piece(0, 0, 1, 0, 0), Piece(1, 1, 1, 0, 1)],
                             [Piece(2, 2, 1, 0, 0), Piece(3, 3, 1, 0, 1)]]
    # kv_heads 2 at decode TP 4: heads replicated on ranks (0, 1) and (2, 3), one fetch each
    assert plan(2, 2, 4) == [[Piece(0, 0, 1, 0, 0)], [Piece(0, 0, 1, 0, 0)], [Piece(1, 1, 1, 0, 0)],
                             [Piece(1, 1, 1, 0, 0)]]
    # both replicate (2 heads, prefill TP 4 -> decode TP 4): each rank to itself; TP 4 -> 2: holders alternate
    assert plan(2, 4, 2) == [[Piece(0, 0, 1, 0, 0)], [Piece(2, 1, 1, 0, 0)]]
    assert plan(2, 4, 8)[0][0].src_rank == 0 and plan(2, 4, 8)[1][0].src_rank == 1  # head 0 from ranks 0 and 1


def test_sends_lists_what_one_prefill_rank_ships() -> None:
    assert sends(plan(4, 1, 2), 0) == [(0, Piece(0, 0, 2, 0, 0)), (1, Piece(0, 2, 2, 2, 0))]
    assert sends(plan(2, 4, 1), 1) == []  # a replica nobody needs from it
    assert [r for r, _ in sends(plan(2, 4, 1), 0)] == [0]


@pytest.mark.parametrize(("heads", "a", "b", "bad"), [(4, 3, 1, "prefill TP 3 with 4 KV heads"),
                                                      (4, 1, 3, "decode TP 3 with 4 KV heads"),
                                                      (4, 1, 6, "decode TP 6 with 4 KV heads"),
                                                      (4, 0, 1, "prefill TP 0"), (0, 1, 1, "KV head count")])
def test_impossible_layout_raises_naming_it(heads: int, a: int, b: int, bad: str) -> None:
    with pytest.raises(ValueError, match=bad):
        plan(heads, a, b)


def test_bytes_per_rank_per_layer() -> None:
    per_head = 2 * 10 * 8 * 4  # K and V, 10 tokens, head_dim 8, f32
    same = layer_bytes(plan(4, 2, 2), 2, tokens=10, head_dim=8)
    assert same.sent == (2 * per_head, 2 * per_head) and same.received == same.sent
    two_to_one = layer_bytes(plan(4, 2, 1), 2, tokens=10, head_dim=8)
    assert two_to_one.sent == (2 * per_head, 2 * per_head) and two_to_one.received == (4 * per_head,)
    one_to_two = layer_bytes(plan(4, 1, 2), 1, tokens=10, head_dim=8)
    assert one_to_two.sent == (4 * per_head,) and one_to_two.received == (2 * per_head, 2 * per_head)
    replicated = layer_bytes(plan(2, 1, 4), 1, tokens=10, head_dim=8)
    assert replicated.sent == (4 * per_head,) and replicated.total == 4 * per_head  # each replica fetched
    int8 = layer_bytes(plan(4, 2, 1), 2, tokens=10, head_dim=8, wire="int8")
    assert int8.total == 4 * 2 * 10 * (8 + 4)
    assert vector_bytes(8, "int4") == 4 + 4 and vector_bytes(8, "bf16") == 16
    with pytest.raises(ValueError, match="wire format"):
        vector_bytes(8, "fp8")
