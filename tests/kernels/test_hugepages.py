"""Host buffers on transparent huge pages (kernels/hugepages.py): the packed weights and the paged KV cache are
madvised before first touch, so where THP runs in `madvise` or `always` mode their memory sits on 2 MiB pages;
anywhere else the buffers are the same tensors on small pages."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdcluster.kernels import allocate_kv_cache, hugepages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


def _huge_bytes(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds ``t``'s first byte (/proc/self/smaps)."""
    addr, found = t.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            found = lo <= addr < hi
        elif found and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def test_zeros_are_zeros_of_the_asked_shape_and_dtype_and_writable() -> None:
    for shape, dtype in (((3,), torch.float32), ((5, 16, 2, 8), torch.int8), ((1 << 20, 3), torch.float16)):
        t = hugepages.zeros(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and not t.any()
        t.fill_(2)
        assert (t == 2).all()
    big = hugepages.zeros((3 << 20,), torch.uint8)
    assert big.data_ptr() % hugepages.HUGE_PAGE == 0  # its own mapping, aligned to a huge page


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason=f"THP is {_thp_mode()!r} here")
def test_a_kv_cache_sits_on_huge_pages() -> None:
    churn = [torch.empty(1 << 22).normal_() for _ in range(8)]  # touched memory for the allocator to reuse
    del churn
    k, v, _, _ = allocate_kv_cache(1024, 16, 4, 64, "auto", torch.float32)  # 16 MiB each
    # faulted in at allocation (an over-large cache fails at start, as with torch.zeros), on huge pages
    assert _huge_bytes(k) >= 8 * hugepages.HUGE_PAGE and _huge_bytes(v) >= 8 * hugepages.HUGE_PAGE
    assert not k.any() and not v.any()
