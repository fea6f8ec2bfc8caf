"""Host buffers on transparent huge pages, where the kernel gives them.

Why: with THP in ``madvise`` mode (the common default) every host tensor sits on 4 KiB pages, and the decode
step's big streams (the packed weights, the paged KV cache) then take a TLB miss every 4 KiB. The batch-1
GEMV streamed the 56M model's weights 11-19 % slower on small pages (fifth pass), and cold batch-16 decode
attention read its cache 3-10 % slower (ninth pass; docs/benchmarks/engine.md at 5f904a5). Best effort: the unaligned
tail of a buffer past its last whole huge page stays on small pages, and a system without ``madvise`` or THP
only loses the speed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import warnings
from collections.abc import Callable

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


@functools.cache
def _madvise() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise: Callable[..., int] = libc.madvise  # ctypes hands out untyped foreign functions
        return madvise
    except (OSError, AttributeError):
        return None


def _host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A host tensor of zeros whose whole 2 MiB pages are madvised ``MADV_HUGEPAGE`` before first touch.

    A buffer of at least a huge page gets fresh private anonymous memory of its own (``mmap``), aligned to
    2 MiB: memory from the allocator may be pages the process already touched, which madvise no longer turns
    into huge ones (a KV cache allocated late in a busy process sat on 4 KiB pages that way). The tensor holds
    the mapping; the alignment slack is never touched, so it costs address space, not memory. Smaller
    buffers are ``torch.zeros``."""
    nbytes = math.prod(shape) * dtype.itemsize
    madvise = _madvise()
    if nbytes < HUGE_PAGE or madvise is None:
        return torch.zeros(shape, dtype=dtype)
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(area))
    offset = -base % HUGE_PAGE
    madvise(ctypes.c_void_p(base + offset), ctypes.c_size_t(nbytes // HUGE_PAGE * HUGE_PAGE), _MADV_HUGEPAGE)
    with warnings.catch_warnings():  # frombuffer's note that the buffer is shared: that is the point
        warnings.simplefilter("ignore")
        raw = torch.frombuffer(area, dtype=torch.uint8, count=nbytes, offset=offset)
    # Fault every page in now, as torch.zeros did: a cache larger than the memory it may use fails at start,
    # not under load (the writes also place it on huge pages where the kernel has them).
    return raw.view(dtype).view(shape).zero_()


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.zeros`` with host memory on huge pages (:func:`_host_zeros`); other devices as ``torch.zeros``."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return _host_zeros(shape, dtype)
