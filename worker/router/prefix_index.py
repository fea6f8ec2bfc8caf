"""The router's approximate view of each worker's prefix cache: which prompt blocks it recently sent where.

Fed from what the router routes (a worker that prefilled a prompt holds its blocks, until memory pressure
evicts them), bounded per worker by that worker's KV cache size (an LRU, as the engine's free list is), and
reset when a worker comes back from being unhealthy (a restart empties its cache). It can be wrong in both
directions (evictions the router does not see; hits from requests it did not route): it only biases the
pick, and the worker's own lookup is what actually reuses KV.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

DEFAULT_CAPACITY = 4096  # blocks per worker while its KV cache size is unknown


class PrefixIndex:
    def __init__(self, default_capacity: int = DEFAULT_CAPACITY) -> None:
        self.default_capacity = default_capacity
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def match(self, url: str, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` this worker is believed to hold."""
        held = self._blocks.get(url)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def record(self, url: str, hashes: Iterable[int], capacity: int | None = None) -> None:
        """`url` now holds these blocks (most recently used); the oldest beyond `capacity` are forgotten."""
        held = self._blocks.setdefault(url, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        cap = capacity if capacity and capacity > 0 else self.default_capacity
        while len(held) > cap:
            held.popitem(last=False)

    def forget(self, url: str) -> None:
        self._blocks.pop(url, None)

    def size(self, url: str) -> int:
        return len(self._blocks.get(url, ()))
