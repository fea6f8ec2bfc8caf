"""The decode step's native kernels (``linear.cpp``, ``attention.cpp``, ``argmax.cpp``, ``norm.cpp``,
``rope.cpp``, ``screen.cpp`` (greedy's LM head screened in bf16), and ``decoder.cpp``, which chains them
through a whole decode step) built as one module, so
they share one work-sharing pool (``pool.h``): one set of helper threads, not one per kernel.

The pool's helpers spin for ``SPIN_US`` microseconds after each shared call, so the dozens of back-to-back
products of a step find them awake, then sleep (``set_spin_us(0)`` makes them sleep at once: every call then
pays a wake-up, which the caller does not wait for, it takes the items itself). After a stall (a helper that
lost its core held up a call) the next ``BACKOFF_CALLS`` calls (doubled for each stall in a row) run on the
calling thread alone. Both are measured constants (docs/benchmarks/engine.md), not deployment settings.
"""

from __future__ import annotations

import functools
from types import ModuleType

from pdcluster.kernels.cpu import native

NAME = "pdc_step"
SOURCES = ["pool.cpp", "linear.cpp", "attention.cpp", "argmax.cpp", "norm.cpp", "rope.cpp", "decoder.cpp",
           "screen.cpp", "step.cpp"]
HEADERS = ("pool.h",)
SPIN_US = 300
BACKOFF_CALLS = 16  # after a first stall; pool.cpp doubles it for each stall in a row, up to its MAX_ALONE


@functools.cache  # kernels call module() on every product: no trip through the loader's lock
def module() -> ModuleType | None:
    """The compiled module, or None where native kernels are off or cannot be built (logged once)."""
    mod = native.load(NAME, SOURCES, HEADERS)
    if mod is not None:
        mod.set_spin_us(SPIN_US)
        mod.set_backoff_calls(BACKOFF_CALLS)
    return mod


def pool_stats() -> dict[str, int]:
    """Counters of the shared pool (calls, shared_calls, items, helper_items, stalls, helpers); empty without
    it."""
    mod = module()
    return dict(mod.pool_stats()) if mod is not None else {}


def loaded_pool_stats() -> dict[str, int]:
    """The pool's counters if this process already loaded the module, else empty: never builds or loads it (a
    metrics scrape on a process that never ran a kernel)."""
    if module.cache_info().currsize == 0:
        return {}
    return pool_stats()
