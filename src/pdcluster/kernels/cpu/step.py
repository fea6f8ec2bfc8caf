"""The decode step's native kernels (``linear.cpp``, ``attention.cpp``, ``argmax.cpp``, ``norm.cpp``,
``rope.cpp``, ``screen.cpp`` (greedy's LM head screened in bf16), and ``decoder.cpp``, which chains them
through a whole decode step) built as one module, so
they share one work-sharing pool (``pool.h``): one set of helper threads, not one per kernel.

The pool's helpers spin for ``PDCLUSTER_NATIVE_SPIN_US`` microseconds (default 300) after each shared call,
so the dozens of back-to-back products of a step find them awake, then sleep; ``0`` makes them sleep at once
(every call then pays a wake-up, which the caller does not wait for: it takes the items itself). After a
stall (a helper that lost its core held up a call) the next ``PDCLUSTER_NATIVE_BACKOFF_CALLS`` calls (default
16, doubled for each stall in a row) run on the calling thread alone.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

from pdcluster.kernels.cpu import native

NAME = "pdc_step"
SOURCES = ["pool.cpp", "linear.cpp", "attention.cpp", "argmax.cpp", "norm.cpp", "rope.cpp", "decoder.cpp",
           "screen.cpp", "step.cpp"]
HEADERS = ("pool.h",)
SPIN_ENV = "PDCLUSTER_NATIVE_SPIN_US"
DEFAULT_SPIN_US = 300
# Calls run on the calling thread alone after a first stall (pool.cpp: doubled for each stall in a row)
BACKOFF_ENV = "PDCLUSTER_NATIVE_BACKOFF_CALLS"
DEFAULT_BACKOFF_CALLS = 16
MAX_BACKOFF_CALLS = 16384  # pool.cpp's MAX_ALONE: the longest stretch alone, whatever the setting


def spin_us() -> int:
    raw = os.environ.get(SPIN_ENV, "")
    try:
        return max(0, int(raw)) if raw else DEFAULT_SPIN_US
    except ValueError:
        raise ValueError(f"{SPIN_ENV}={raw!r}: expected a whole number of microseconds") from None


def backoff_calls() -> int:
    raw = os.environ.get(BACKOFF_ENV, "")
    try:
        value = int(raw) if raw else DEFAULT_BACKOFF_CALLS
    except ValueError:
        value = 0  # refused below, with the same message as an out-of-range number
    if not 1 <= value <= MAX_BACKOFF_CALLS:
        raise ValueError(f"{BACKOFF_ENV}={raw!r}: expected a whole number of calls (1..{MAX_BACKOFF_CALLS})")
    return value


@functools.cache  # kernels call module() on every product: no trip through the loader's lock
def module() -> ModuleType | None:
    """The compiled module, or None where native kernels are off or cannot be built (logged once)."""
    mod = native.load(NAME, SOURCES, HEADERS)
    if mod is not None:
        mod.set_spin_us(spin_us())
        mod.set_backoff_calls(backoff_calls())
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
