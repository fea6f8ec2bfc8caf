"""Block manager: on-demand allocation, ref counts, prefix sharing by chained hashes, LRU eviction."""

from __future__ import annotations

import pytest

from pdcluster.worker.engine.block_manager import BlockManager
from pdcluster.worker.engine.sampling_params import SamplingParams
from pdcluster.worker.engine.sequence import Sequence


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams())


def computed(bm: BlockManager, s: Sequence, n: int) -> None:
    """Pretend the forward wrote KV for the first n tokens."""
    s.num_computed_tokens = n
    bm.commit(s)


def test_allocate_on_demand_and_free():
    bm = BlockManager(8, 8)
    s = seq(list(range(20)))
    assert bm.cost(s, 20) == 3
    assert bm.allocate(s, 12)  # first chunk: 2 blocks
    assert len(s.block_table) == 2 and bm.num_free_blocks == 6
    assert bm.allocate(s, 20)  # next chunk: one more
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    bm.free_seq(s)
    bm.check_no_leaks()


def test_allocation_respects_reserve_and_changes_nothing_on_failure():
    bm = BlockManager(4, 8)
    s = seq(list(range(30)))
    assert not bm.allocate(s, 30, reserve=1)  # needs 4, would leave 0 < 1
    assert s.block_table == [] and bm.num_free_blocks == 4
    assert bm.allocate(s, 30)
    assert bm.allocate_blocks(1) is None
    bm.free_seq(s)
    bm.check_no_leaks()


def test_prefix_sharing_and_refcounts():
    bm = BlockManager(16, 8)
    a = seq(list(range(30)), "a")
    bm.allocate(a, 30)
    computed(bm, a, 30)  # 3 full blocks published
    b = seq(list(range(24)) + [99, 98, 97], "b")
    hits = bm.lookup_prefix(b)
    assert hits == a.block_table[:3]
    assert bm.cost(b, len(b), hits) == 1  # only the tail block is new
    assert bm.allocate(b, len(b), hits)
    assert b.num_computed_tokens == b.num_cached_tokens == 24
    assert all(bm.blocks[i].ref_count == 2 for i in hits)
    bm.free_seq(a)
    assert all(bm.blocks[i].ref_count == 1 for i in hits)  # still used by b
    bm.free_seq(b)
    bm.check_no_leaks()


def test_diverging_prefix_stops_matching_and_last_token_is_never_cached():
    bm = BlockManager(16, 8)
    a = seq(list(range(16)), "a")
    bm.allocate(a, 16)
    computed(bm, a, 16)
    bm.free_seq(a)  # freed blocks stay in the prefix cache
    same = seq(list(range(16)), "same")
    assert len(bm.lookup_prefix(same)) == 1  # the 2nd block holds the last token: recomputed for its logits
    other = seq([1000] + list(range(1, 16)), "other")
    assert bm.lookup_prefix(other) == []  # chained: a different first block changes every later hash


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(4, 8)
    a = seq(list(range(17)), "a")
    bm.allocate(a, 17)
    computed(bm, a, 17)
    bm.free_seq(a)
    b = seq(list(range(8)) + [5] * 9, "b")
    hits = bm.lookup_prefix(b)
    assert len(hits) == 1 and bm.cost(b, 17, hits) == 3  # the hit is free, so it costs a free-list entry too
    assert bm.allocate(b, 17, hits)
    bm.free_seq(b)
    # take every block: cached content must be forgotten when a block is handed out again
    c = seq([7] * 32, "c")
    assert bm.allocate(c, 32)
    assert bm.hash_to_block == {} or all(bm.blocks[i].ref_count for i in bm.hash_to_block.values())
    assert bm.lookup_prefix(seq(list(range(17)))) == []
    bm.free_seq(c)
    bm.check_no_leaks()


def test_double_free_is_caught():
    bm = BlockManager(2, 8)
    ids = bm.allocate_blocks(1)
    bm.free_blocks(ids)
    with pytest.raises(AssertionError):
        bm.free_blocks(ids)


@pytest.mark.parametrize("bad", [4, 12, 64])
def test_block_size_is_validated(bad):
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(8, bad)
