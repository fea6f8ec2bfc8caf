"""Regions of one registered staging buffer (the NIXL backend registers its buffer once, never per
transfer): a first-fit allocator over byte offsets, safe to call from encoder threads and the event loop.

Never blocks: `alloc` answers None when no hole is large enough, and the caller decides (the sender ships
that layer over TCP instead; the receiver waits for a region to come back). Regions are aligned so that
every tensor view of one is aligned for its dtype.
"""

from __future__ import annotations

import bisect
import threading

ALIGN = 64  # a cache line: any dtype's alignment, and no two regions share a line


class Staging:
    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError("staging size must be positive")
        self.size = size
        self._starts: list[int] = []  # sorted offsets of live regions
        self._ends: dict[int, int] = {}  # offset -> end (aligned)
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        with self._lock:
            return sum(end - start for start, end in self._ends.items())

    @property
    def regions(self) -> int:
        return len(self._ends)

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free region of `nbytes` (first fit), or None when there is none."""
        if nbytes <= 0:
            raise ValueError("a region has at least one byte")
        need = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            cursor = 0
            for i, start in enumerate(self._starts):
                if start - cursor >= need:
                    return self._take(i, cursor, need)
                cursor = self._ends[start]
            if self.size - cursor >= need:
                return self._take(len(self._starts), cursor, need)
        return None

    def _take(self, index: int, offset: int, need: int) -> int:
        self._starts.insert(index, offset)
        self._ends[offset] = offset + need
        return offset

    def free(self, offset: int) -> None:
        """Give a region back; freeing an unknown offset is an error (it would hide a double free)."""
        with self._lock:
            if offset not in self._ends:
                raise KeyError(f"no staging region at offset {offset}")
            del self._ends[offset]
            del self._starts[bisect.bisect_left(self._starts, offset)]
