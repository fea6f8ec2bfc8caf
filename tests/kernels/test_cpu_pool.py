"""The work-sharing pool the decode step's native kernels share (kernels/cpu/pool.cpp): helpers really take
items, results do not depend on who ran them, and a forked child gets a working pool of its own."""

from __future__ import annotations

import os

import pytest
import torch

from pdcluster.kernels.cpu import attention as cpu_attn
from pdcluster.kernels.cpu import linear as L
from pdcluster.kernels.cpu import native, step
from tests.native_marks import needs_native

pytestmark = needs_native


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_one_module_for_linear_and_attention():
    assert L.module() is cpu_attn.module() is step.module()


def test_helpers_take_items_and_bits_do_not_change(two_threads):
    torch.manual_seed(0)
    w, x = torch.randn(32000, 512), torch.randn(3, 512)
    wp = L.pack(w)
    alone = L.linear(x, wp, 32000, panels_per_task=0)
    before = step.pool_stats()
    for _ in range(300):  # ~1-3 ms each; a helper spinning or woken gets a core long before the end
        assert torch.equal(L.linear(x, wp, 32000, panels_per_task=1), alone)
        if step.pool_stats()["helper_items"] > before["helper_items"]:
            break
    after = step.pool_stats()
    assert after["shared_calls"] > before["shared_calls"] and after["helpers"] >= 1
    assert after["helper_items"] > before["helper_items"], (before, after)


def test_one_thread_means_no_sharing():
    before_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        before = step.pool_stats()
        L.linear(torch.randn(2, 64), L.pack(torch.randn(1024, 64)), 1024, panels_per_task=1)
        assert step.pool_stats()["shared_calls"] == before["shared_calls"]
    finally:
        torch.set_num_threads(before_threads)


def test_sleeping_helpers_still_finish_every_call(two_threads):
    """Spin 0: helpers sleep after each call and every call must still complete (the caller takes what
    nobody claimed) with the same bits."""
    mod = step.module()
    torch.manual_seed(1)
    wp = L.pack(torch.randn(4096, 256))
    x = torch.randn(5, 256)
    alone = L.linear(x, wp, 4096, panels_per_task=0)
    mod.set_spin_us(0)
    try:
        for _ in range(200):
            assert torch.equal(L.linear(x, wp, 4096, panels_per_task=1), alone)
    finally:
        mod.set_spin_us(step.SPIN_US)


def test_forked_child_has_a_working_pool(two_threads):
    torch.manual_seed(2)
    wp = L.pack(torch.randn(8192, 256))
    x = torch.randn(4, 256)
    want = L.linear(x, wp, 8192, panels_per_task=0)
    L.linear(x, wp, 8192, panels_per_task=1)  # helpers running in the parent at fork time
    pid = os.fork()
    if pid == 0:  # the child: exit status says whether the shared product was right
        ok = all(torch.equal(L.linear(x, wp, 8192, panels_per_task=1), want) for _ in range(20))
        # shared (not bypassed) from the first call on; on a loaded box a stall may send later calls to the
        # caller alone, which is the back-off working, not a broken pool
        os._exit(0 if ok and step.pool_stats()["shared_calls"] >= 1 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_stalled_helper_makes_the_next_calls_run_alone(two_threads):
    """A helper that holds an item far longer than the caller worked (it lost its core) is a stall: the next
    calls (step.BACKOFF_CALLS, at least) run on the caller alone, then sharing is tried again."""
    mod = step.module()
    assert mod is not None

    def shares_next_call() -> bool:
        before = step.pool_stats()["shared_calls"]
        mod.pool_probe(2, 0, 0)
        return step.pool_stats()["shared_calls"] == before + 1

    assert any(shares_next_call() for _ in range(20000))  # out of any back-off an earlier call caused
    stalled = False
    for _ in range(20):
        before = step.pool_stats()
        # the helper must join (64 items of 20 us give it ~1.3 ms to wake), then its 50 ms item is a stall
        # unless the caller itself lost its core for longer than that (a loaded box): try again then
        if mod.pool_probe(64, 20, 50000) > 0 and step.pool_stats()["stalls"] > before["stalls"]:
            stalled = True
            break
        assert any(shares_next_call() for _ in range(20000))  # out of any back-off, for the next try
    assert stalled
    assert not any(shares_next_call() for _ in range(step.BACKOFF_CALLS))  # alone, not waiting for a helper
    assert any(shares_next_call() for _ in range(20000))  # and sharing again after the back-off


def test_the_engine_reports_the_pools_counters() -> None:
    """The pool's counters that AsyncEngine.stats() (what /metrics exports) carries once the module is loaded;
    reading them never loads it."""
    assert step.module() is not None
    assert native.outcomes()["pdc_step"] is True  # pdcluster_native_kernel_loaded{kernel="pdc_step"} 1
    loaded = step.loaded_pool_stats()
    assert {"calls", "shared_calls", "stalls"} <= set(loaded) and loaded["calls"] >= 0
