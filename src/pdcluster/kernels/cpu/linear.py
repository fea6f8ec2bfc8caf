"""The native fp32 small-M linear (linear.cpp): weight packing, the kernel call, and its torch reference.

``pack(w)`` turns a ``[N, K]`` weight into ``[ceil(N/64), K, 64]`` panels (zero-padded past N) once at load;
``linear(x, wp, n, bias)`` is ``x @ W.T + bias`` on them for ``x [M, K]``. The packed tensor is the only
copy a swapped model keeps, so ``rows(wp, ids)`` reads rows of W back out of it (a tied embedding lookup)
and ``mkl_packed(x, wp, n)`` runs MKL on the panels for large M without a second resident copy.
"""

from __future__ import annotations

from types import ModuleType

import torch

from pdcluster.kernels import hugepages
from pdcluster.kernels.cpu import native, step

NR = 64  # output columns per panel (linear.cpp)
# Multiply-adds an item of a shared product must hold (items are runs of panels claimed through pool.h). With
# the pool's helpers awake during a step a split pays even at batch 1 (the 33 products of a step: 9.1 ms alone,
# 6.3 ms shared, 2026-12-02); 1 to 32 items per product measured the same, so this only keeps an item long
# enough for the next-panel prefetch. (With at::parallel_for it had to be 16M: docs/benchmarks/engine.md at 5f904a5.)
MIN_TASK_MACS = 1 << 17


# Above ROWS_PER_CHUNK rows a panel is computed in several row chunks, and each chunk prefetches its share of
# the item's next panel (linear.cpp); an item of one panel prefetches nothing, so its first chunk waits on
# DRAM. A product of many panels (the LM head) is therefore shared in ~PREFETCH_ITEMS items: cold 16-row LM
# head 3.94 -> 3.23 ms, a step's 33 products 1.07-1.11x (docs/benchmarks/engine.md at 5f904a5, tenth pass). Products of
# fewer panels keep small items: there the balance over the threads mattered more (0.97-0.99x).
ROWS_PER_CHUNK = 6  # linear.cpp's MAX_MR
PREFETCH_ITEMS = 32
MIN_PREFETCH_PANELS = 128
# Decode-sized products (up to LONG_ITEM_ROWS rows) are shared in ITEMS_PER_THREAD items per pool thread:
# long runs of panels, so nearly every panel has a next one streaming in while it computes. On the second
# benchmark host (Xeon model 207, eleventh pass) a step's 33 products went 1.20-1.25x faster at 16 rows,
# 1.08-1.22x at 4, 1.24x at 8, 1.01-1.03x at 1 (the first host had measured 0.97-0.99x for larger items);
# an item count that is not a multiple of the threads lost to the imbalance (3 items on 2 threads: 1.08x at
# 16 rows), and prefill-sized products kept the old rule (4 items at 512 rows: 0.94x).
LONG_ITEM_ROWS = 16
ITEMS_PER_THREAD = 2


def grain(m: int, k: int, panels: int, min_task_macs: int = MIN_TASK_MACS, threads: int | None = None) -> int:
    """Panels per shared item of an ``m``-row product over ``panels`` panels of depth ``k`` on ``threads``
    pool threads (torch's count by default); 0 = the calling thread only (a product of one item)."""
    per_panel = m * k * NR
    if per_panel == 0:  # no rows (a step can carry an empty chunk) or K = 0: nothing to split
        return 0
    g = max(1, -(-min_task_macs // per_panel))
    if m <= LONG_ITEM_ROWS:
        items = ITEMS_PER_THREAD * max(1, threads if threads is not None else torch.get_num_threads())
        g = max(g, -(-panels // items))
    elif panels >= MIN_PREFETCH_PANELS:
        g = max(g, panels // PREFETCH_ITEMS)
    return 0 if g >= panels else g


def module() -> ModuleType | None:
    """The compiled kernel, or None (logged once) where native kernels are off or cannot be built."""
    return step.module()


def ready() -> bool:
    """The kernel can run here now (re-reads the switch each time, so a test can flip it)."""
    return native.enabled("linear") and native.unrunnable_reason() is None and module() is not None


def pack(w: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` weight (any strides) -> contiguous fp32 ``[ceil(N/64), K, 64]`` panels, zero-padded."""
    n, k = w.shape
    nb = -(-n // NR)
    out = hugepages.zeros((nb, k, NR), torch.float32)  # streamed every step: no TLB miss every 4 KiB
    full = n // NR
    out[:full].copy_(w[: full * NR].reshape(full, NR, k).transpose(1, 2))
    if full < nb:  # the last panel: N's tail (zero past it: hugepages.zeros)
        out[full, :, : n - full * NR].copy_(w[full * NR :].t())
    return out


def unpack(wp: torch.Tensor, n: int) -> torch.Tensor:
    """The ``[N, K]`` weight back from its panels (a copy)."""
    nb, k, _ = wp.shape
    return wp.transpose(1, 2).reshape(nb * NR, k)[:n]


def rows(wp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of W (``[len(ids), K]``) read from the panels: W[i, :] = wp[i // 64, :, i % 64]."""
    return wp[ids // NR, :, ids % NR]


def linear(x: torch.Tensor, wp: torch.Tensor, n: int, bias: torch.Tensor | None = None, prefetch: bool = True,
           panels_per_task: int | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T + bias`` by the native kernel (the caller checked ``module()`` is not None);
    ``panels_per_task`` overrides the threading policy (``grain``): 0 = the calling thread only."""
    mod = module()
    assert mod is not None, "native linear kernel not available"
    if x.stride(-1) != 1:
        x = x.contiguous()
    g = grain(x.shape[0], wp.shape[1], wp.shape[0]) if panels_per_task is None else panels_per_task
    return mod.packed_linear(x, wp, n, bias, prefetch, g)


def mkl_packed(x: torch.Tensor, wp: torch.Tensor, n: int) -> torch.Tensor:
    """``x [M, K] @ W.T`` by MKL straight from the panels (a batched GEMM, ``[NB, M, 64]``, then ``[M, N]``):
    the large-M path, which needs no second copy of W."""
    return torch.matmul(x, wp).transpose(0, 1).reshape(x.shape[0], -1)[:, :n]


def reference(x: torch.Tensor, wp: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product by torch (MKL), from the panels: what the kernel is checked against."""
    return torch.nn.functional.linear(x, unpack(wp, n), bias)
