"""Paged KV block accounting: on-demand allocation, ref counts, and prefix caching by chained block hashes.

A full block is identified by hash(previous block's hash, its token ids), so equal hashes mean equal
prefixes, and a new prompt can reuse every leading block another request already computed. Freed blocks
keep their hash and sit in an LRU free list; they are only forgotten when handed out again, so a finished
request's prefix stays reusable until memory is actually needed. All operations are O(1) per block.

Evictions are logged (bounded, numbered) so the router's prefix index can be corrected: see prefix_report.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict, deque
from itertools import islice
from typing import Any

from pdcluster.worker.engine.block_hash import chain_hash  # shared with the router's prefix index
from pdcluster.worker.engine.sequence import Sequence

EVICTION_LOG_MAX = 65536  # entries kept for readers that fall behind (then they get the resident set)


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()  # kept to rule out hash collisions


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be 8, 16 or 32, got {block_size}")
        if num_blocks < 1:
            raise ValueError("the KV cache has room for no block; raise the KV cache memory budget")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU order
        self.hash_to_block: dict[int, int] = {}
        self.prefix_hits = 0  # blocks reused from the prefix cache (for stats)
        self.prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache (hit rate's denominator)
        # Hashes evicted from the prefix cache, oldest first; entry i has number evict_seq - len + 1 + i. The
        # epoch names this cache's life (a restarted worker has a new one), so a reader's "since" is never
        # applied to another cache's numbering.
        self.epoch = secrets.token_hex(8)
        self.evicted: deque[int] = deque(maxlen=max(1024, min(4 * num_blocks, EVICTION_LOG_MAX)))
        self.evict_seq = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation -------------------------------------------------------------------------------------

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks covering a leading run of ``seq``'s full blocks. Pure; nothing is taken yet.

        The last prompt token is never served from the cache: its logits are needed to sample.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return []
        hits: list[int] = []
        prev: int | None = None
        bs = self.block_size
        for i in range((len(seq) - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(prev, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            prev = h
        return hits

    def cost(self, seq: Sequence, num_tokens: int, prefix: list[int] | None = None) -> int:
        """Free-list entries needed so that ``seq`` has blocks for ``num_tokens`` tokens."""
        prefix = prefix or []
        fresh = max(0, self.blocks_for(num_tokens) - len(seq.block_table) - len(prefix))
        return fresh + sum(1 for b in prefix if self.blocks[b].ref_count == 0)

    def allocate(
        self, seq: Sequence, num_tokens: int, prefix: list[int] | None = None, reserve: int = 0
    ) -> bool:
        """Give ``seq`` blocks for ``num_tokens`` tokens, reusing ``prefix`` (from lookup_prefix) first.

        Returns False, changing nothing, if that would leave fewer than ``reserve`` blocks free.
        """
        if self.num_free_blocks - self.cost(seq, num_tokens, prefix) < reserve:
            return False
        if self.enable_prefix_caching and not seq.block_table:  # a (re)started prefill: one cache query
            self.prefix_query_tokens += len(seq)
        if prefix:
            assert not seq.block_table
            for block_id in prefix:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free[block_id]
                block.ref_count += 1
                seq.block_table.append(block_id)
                assert block.hash is not None
                seq.block_hashes.append(block.hash)
            seq.num_computed_tokens = seq.num_cached_tokens = len(prefix) * self.block_size
            self.prefix_hits += len(prefix)
        while len(seq.block_table) < self.blocks_for(num_tokens):
            seq.block_table.append(self._take_free())
        return True

    def allocate_blocks(self, n: int) -> list[int] | None:
        """``n`` anonymous blocks (swap space, imports), or None if there are not enough."""
        if n > self.num_free_blocks:
            return None
        return [self._take_free() for _ in range(n)]

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]  # evict it from the prefix cache: its content is about to change
            self.evicted.append(block.hash)
            self.evict_seq += 1
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def free_blocks(self, block_ids: list[int]) -> None:
        # Reverse order: a sequence's tail is the least likely to be shared, so it is evicted first.
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None

    def free_seq(self, seq: Sequence) -> None:
        self.free_blocks(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    # -- prefix cache -----------------------------------------------------------------------------------

    def commit(self, seq: Sequence) -> None:
        """Publish ``seq``'s newly completed full blocks in the prefix cache (after their KV was written)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(seq.block_hashes[-1] if i else None, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self.hash_to_block and block.hash is None:
                self.hash_to_block[h] = block.block_id
                block.hash, block.token_ids = h, tokens

    def resident_hashes(self) -> list[int]:
        """Every hash the prefix cache holds, next to be evicted first: cached free blocks in LRU order, then
        the blocks in use (not evictable now)."""
        free = [b.hash for b in (self.blocks[i] for i in self.free)
                if b.hash is not None and self.hash_to_block.get(b.hash) == b.block_id]
        return free + [h for h, i in self.hash_to_block.items() if self.blocks[i].ref_count > 0]

    def prefix_report(self, epoch: str | None = None, since: int | None = None) -> dict[str, Any]:
        """What changed in the prefix cache since eviction number `since` of `epoch`: the hashes evicted after
        it and not cached again since (a prefix recomputed after its eviction is held again, so reporting it
        would make the reader forget a block that is there). When the reader's position is unknown (first
        call, another epoch, or entries it needs fell off the bounded log) the whole resident set instead."""
        first = self.evict_seq - len(self.evicted)  # number of the last entry no longer kept
        if epoch == self.epoch and since is not None and first <= since <= self.evict_seq:
            gone = dict.fromkeys(islice(self.evicted, since - first, None))
            evicted = [h for h in gone if h not in self.hash_to_block]
            return {"epoch": self.epoch, "seq": self.evict_seq, "evicted": evicted, "resident": None}
        return {"epoch": self.epoch, "seq": self.evict_seq, "evicted": [], "resident": self.resident_hashes()}

    def check_no_leaks(self) -> None:
        """For tests: every block is free and none has a dangling ref count."""
        assert self.num_free_blocks == self.num_blocks, f"{self.num_used_blocks} block(s) leaked"
        assert all(b.ref_count == 0 for b in self.blocks)
