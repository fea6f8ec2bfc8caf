"""Reusable host buffers for the KV transport's big transient memory (received frame bodies, export buffers).

A fresh buffer of tens of MiB is fresh pages: the kernel faults and zero-fills each 4 KiB page on first
touch, which on this transport's hot path (the socket copying a body in, the engine gathering a layer out)
costs as much as the copy itself (measured: a 64 MiB copy into reused memory 10 GB/s, into fresh memory
1.9 GB/s). Buffers handed back are kept, up to `max_bytes` in all, and lent again to the next body or
export that fits; small ones are not worth keeping and come from plain bytearrays.

The caller owns the rule that makes reuse safe: a buffer is given back only once nothing reads or writes it
any more (the receiver after the importer returned; the sender after the frame's ACK). A buffer never given
back (a failed transfer, an aborted one) is simply garbage collected.
"""

from __future__ import annotations

import threading

import numpy as np

MIN_POOLED = 1 << 16  # below this, allocation is cheap (malloc's heap, no fresh pages)
ROUND = 1 << 16


class BufferPool:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: list[np.ndarray] = []  # kept blocks, any order
        self._lock = threading.Lock()  # the engine thread, encoder threads and the event loop all use it
        self.reused = 0  # takes served from a kept block (metrics, tests)

    @property
    def kept_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._free)

    def take(self, n: int) -> memoryview:
        """A writable view of exactly `n` bytes (contents undefined)."""
        if n < MIN_POOLED:
            return memoryview(bytearray(n))
        with self._lock:
            # the smallest kept block that fits without wasting more than half of it
            fits = [i for i, b in enumerate(self._free) if n <= b.nbytes <= 2 * n]
            if fits:
                block = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))  # by index: == on arrays is elementwise
                self.reused += 1
                return block.data[:n]  # ndarray.data: its memoryview, whose .obj is the array
        return np.empty(-(-n // ROUND) * ROUND, dtype=np.uint8).data[:n]

    def give(self, view: memoryview) -> None:
        """Hand back a view `take` returned: nobody may touch its bytes afterwards."""
        block = view.obj
        if not isinstance(block, np.ndarray) or block.nbytes < MIN_POOLED:
            return
        with self._lock:
            if any(b is block for b in self._free):
                raise RuntimeError("buffer given back twice")
            self._free.append(block)
            total = sum(b.nbytes for b in self._free)
            while total > self.max_bytes and self._free:  # keep the newest; the oldest go to the GC
                total -= self._free.pop(0).nbytes
