"""The block manager's eviction report for the router's prefix index: numbered, bounded, filtered by what is
cached again, and the whole resident set when a reader's position does not apply."""

from __future__ import annotations

from pdcluster.worker.engine.block_hash import prompt_block_hashes
from pdcluster.worker.engine.block_manager import BlockManager
from pdcluster.worker.engine.sampling_params import SamplingParams
from pdcluster.worker.engine.sequence import Sequence


def run(bm: BlockManager, tokens: list[int], rid: str = "r") -> Sequence:
    """Prefill `tokens` (the KV written and committed) and finish: the blocks stay cached on the free list."""
    s = Sequence(rid, tokens, SamplingParams())
    assert bm.allocate(s, len(tokens), bm.lookup_prefix(s))
    s.num_computed_tokens = len(tokens)
    bm.commit(s)
    bm.free_seq(s)
    return s


def test_evictions_are_reported_after_the_readers_position() -> None:
    bm = BlockManager(4, 8)
    a = list(range(33))  # 4 full blocks (the 33rd token makes the 4th cacheable for the router too)
    run(bm, a[:32], "a")
    first = bm.prefix_report()
    assert first["resident"] is not None and sorted(first["resident"]) == sorted(prompt_block_hashes(a, 8))
    assert first["seq"] == 0 and first["evicted"] == []
    run(bm, list(range(500, 516)), "b")  # 2 blocks: the two least recently used of `a` go (its tail first)
    rep = bm.prefix_report(first["epoch"], first["seq"])
    assert rep["resident"] is None and rep["seq"] == 2
    assert sorted(rep["evicted"]) == sorted(prompt_block_hashes(a, 8)[2:])
    assert bm.prefix_report(rep["epoch"], rep["seq"])["evicted"] == []  # nothing new since


def test_a_block_cached_again_after_its_eviction_is_not_reported() -> None:
    """The router may have sent that prefix again meanwhile: reporting it would make it forget a held block."""
    bm = BlockManager(4, 8)
    a = list(range(16))
    run(bm, a, "a")
    pos = bm.prefix_report()
    run(bm, list(range(100, 132)), "b")  # evicts both of `a`'s blocks
    run(bm, a, "a2")  # ... and `a` is computed again, evicting two of `b`'s
    rep = bm.prefix_report(pos["epoch"], pos["seq"])
    again = set(prompt_block_hashes(a + [0], 8))
    assert not again & set(rep["evicted"]) and len(rep["evicted"]) == 2


def test_another_epoch_or_a_lost_position_gets_the_resident_set_lru_first() -> None:
    bm = BlockManager(4, 8)
    bm.evicted = type(bm.evicted)(maxlen=2)  # a tiny log, to overflow it
    run(bm, list(range(16)), "a")
    pos = bm.prefix_report()
    for i in range(3):
        run(bm, list(range(100 * (i + 2), 100 * (i + 2) + 16)), f"b{i}")  # b0 fills the cache, then 2 each
    assert bm.evict_seq == 4
    lost = bm.prefix_report(pos["epoch"], pos["seq"])  # entries 1..2 fell off the log
    assert lost["resident"] is not None and len(lost["resident"]) == 4
    newest = prompt_block_hashes(list(range(400, 416)) + [0], 8)
    assert set(lost["resident"][-2:]) == set(newest)  # the most recently used last (its tail evicted first)
    assert lost["resident"][-1] == newest[0]
    assert BlockManager(4, 8).prefix_report(bm.epoch, 0)["resident"] == []  # a restarted worker: its own epoch
    assert bm.prefix_report(bm.epoch, 2)["resident"] is None  # still in the log
    assert bm.prefix_report("another", 4)["resident"] is not None
    assert bm.prefix_report(bm.epoch, 5)["resident"] is not None  # a position from the future: not trusted


def test_the_log_is_bounded() -> None:
    bm = BlockManager(2, 8)
    assert bm.evicted.maxlen is not None and bm.evicted.maxlen <= 65536
    for i in range(3000):
        run(bm, [i % 250] * 8 + [i // 250] * 8, f"r{i}")
    assert bm.evict_seq > bm.evicted.maxlen and len(bm.evicted) == bm.evicted.maxlen
