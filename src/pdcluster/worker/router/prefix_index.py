"""The router's approximate view of each worker's prefix cache: which prompt blocks it holds.

Fed from what the router routes (a worker that prefilled a prompt holds its blocks), bounded per worker by
that worker's KV cache size (an LRU, as the engine's free list is), and corrected by the worker itself:
each worker reports the blocks its cache evicted (GET /internal/prefix-events, polled by the pool) and,
on first contact, after a restart or periodically, the whole set it holds, which also drops blocks of
requests that failed and adds hits from requests another router sent. It only biases the pick; the
worker's own lookup is what actually reuses KV.

A report describes the worker as of some moment after the poll was sent, and may be older than a request
the router dispatched meanwhile (the worker evicted a block, then the router sent a prompt that computes it
again). So every entry remembers when the router last touched it, a report never removes an entry touched
after its poll was sent, and the router touches a prompt's blocks again when its first token comes back
(by then the worker has committed them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_CAPACITY = 4096  # blocks per worker while its KV cache size is unknown
NEVER = float("-inf")  # touch time of entries learned from a worker's report, not from routing


@dataclass(frozen=True)
class PrefixReport:
    """One answer of a worker's /internal/prefix-events."""

    epoch: str
    seq: int
    evicted: tuple[int, ...] = ()
    resident: tuple[int, ...] | None = None  # the whole set, LRU first (replaces the index), or None


def _ints(v: Any) -> tuple[int, ...] | None:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return None
    return tuple(v)


def parse_report(d: Any) -> PrefixReport | None:
    """A worker's report, or None when it is malformed (then it is ignored, never half-applied)."""
    if not isinstance(d, dict):
        return None
    epoch, seq = d.get("epoch"), d.get("seq")
    if not isinstance(epoch, str) or not epoch or not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        return None
    evicted = _ints(d.get("evicted", []))
    resident = None if d.get("resident") is None else _ints(d.get("resident"))
    if evicted is None or (d.get("resident") is not None and resident is None):
        return None
    return PrefixReport(epoch, seq, evicted, resident)


class PrefixIndex:
    def __init__(self, default_capacity: int = DEFAULT_CAPACITY) -> None:
        self.default_capacity = default_capacity
        self._blocks: dict[str, OrderedDict[int, float]] = {}  # url -> block hash -> last touched (monotonic)

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

    def _cap(self, capacity: int | None) -> int:
        return capacity if capacity and capacity > 0 else self.default_capacity

    def record(self, url: str, hashes: Iterable[int], capacity: int | None = None, now: float = 0.0) -> None:
        """`url` now holds these blocks (most recently used); the oldest beyond `capacity` are forgotten."""
        held = self._blocks.setdefault(url, OrderedDict())
        for h in hashes:
            held[h] = now
            held.move_to_end(h)
        self._trim(held, self._cap(capacity))

    @staticmethod
    def _trim(held: OrderedDict[int, float], cap: int) -> None:
        while len(held) > cap:
            held.popitem(last=False)

    def evict(self, url: str, hashes: Iterable[int], before: float) -> int:
        """The worker evicted these blocks: forget those not touched since `before`. Returns how many went."""
        held = self._blocks.get(url)
        if not held:
            return 0
        gone = 0
        for h in hashes:
            t = held.get(h)
            if t is not None and t < before:
                del held[h]
                gone += 1
        return gone

    def replace(self, url: str, resident: Iterable[int], before: float, capacity: int | None = None) -> None:
        """The worker holds exactly `resident` (LRU first): that becomes the index, plus the entries touched
        since `before` (prompts the report may predate), kept most recent."""
        old = self._blocks.get(url) or OrderedDict()
        recent = [(h, t) for h, t in old.items() if t >= before]
        held: OrderedDict[int, float] = OrderedDict((h, NEVER) for h in resident)
        for h, t in recent:
            held[h] = t
            held.move_to_end(h)
        self._trim(held, self._cap(capacity))
        self._blocks[url] = held

    def apply(self, url: str, report: PrefixReport, before: float, capacity: int | None = None) -> None:
        """A worker's report, from a poll sent at `before` (router monotonic time)."""
        if report.resident is not None:
            self.replace(url, report.resident, before, capacity)
        else:
            self.evict(url, report.evicted, before)

    def forget(self, url: str) -> None:
        self._blocks.pop(url, None)

    def size(self, url: str) -> int:
        return len(self._blocks.get(url, ()))
