"""How many intra-op (OpenMP) threads a small piece of a CPU decode step may use.

A batch-1..16 decode attention over the paged cache is a few hundred microseconds of work split into a
gather per K/V and one SDPA, each of which opens an OpenMP parallel region once it is over torch's grain
size. With 2 threads every region ends in a barrier; when the partner thread is late (a busy box, the HTTP
loop on the other core, a worker asleep after its spin) the region waits for it. Measured side by side on
the 2-core VM (docs/benchmarks/engine.md, 2026-12-01 evening): one layer's decode attention at 1 thread vs
2, best of 300: 87 vs 408 us at batch 1 (190 positions), 1.7 vs 2.4 ms at batch 16 (3,040 positions), and
the medians apart by 5-10x under load. So such attention runs on the calling thread alone; larger ones
(where splitting heads could pay) keep the configured threads. GEMMs are untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Gathered KV positions (rows x length) up to which decode attention runs on one thread: the largest
# size measured to win on one thread (16 x 190 = 3,040), rounded up; above it the evidence is missing.
SINGLE_THREAD_POSITIONS = 4096


def decode_attention_threads(positions: int, device_type: str) -> int | None:
    """Threads for a decode attention over ``positions`` gathered KV positions; None: leave them as set."""
    if device_type != "cpu" or positions > SINGLE_THREAD_POSITIONS:
        return None
    return 1


@contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """Run the block with at most ``threads`` torch intra-op threads (the calling thread's setting), then
    restore it. Setting the count is a few hundred nanoseconds; None or no reduction does nothing."""
    before = torch.get_num_threads()
    if threads is None or threads >= before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
