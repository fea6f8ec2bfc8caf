"""The work-sharing pool the decode step's native kernels share (kernels/cpu/pool.cpp): helpers really take
items, results do not depend on who ran them, and a forked child gets a working pool of its own."""

from __future__ import annotations

import os

import pytest
import torch

from pdcluster.kernels.cpu import attention as cpu_attn
from pdcluster.kernels.cpu import linear as L
from pdcluster.kernels.cpu import native, step

pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None,
                                reason=f"native kernels unavailable here: {native.unavailable_reason()}")


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
    for _ in range(30):  # ~1-3 ms each: a helper spinning or woken gets a core long before 30 have passed
        assert torch.equal(L.linear(x, wp, 32000, panels_per_task=1), alone)
    after = step.pool_stats()
    assert after["shared_calls"] - before["shared_calls"] == 30
    assert after["helpers"] >= 1
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


def test_spin_setting_is_validated(monkeypatch):
    monkeypatch.setenv(step.SPIN_ENV, "0")
    assert step.spin_us() == 0
    monkeypatch.setenv(step.SPIN_ENV, "soon")
    with pytest.raises(ValueError, match=step.SPIN_ENV):
        step.spin_us()
    monkeypatch.delenv(step.SPIN_ENV)
    assert step.spin_us() == step.DEFAULT_SPIN_US


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
        mod.set_spin_us(step.spin_us())


def test_forked_child_has_a_working_pool(two_threads):
    torch.manual_seed(2)
    wp = L.pack(torch.randn(8192, 256))
    x = torch.randn(4, 256)
    want = L.linear(x, wp, 8192, panels_per_task=0)
    L.linear(x, wp, 8192, panels_per_task=1)  # helpers running in the parent at fork time
    pid = os.fork()
    if pid == 0:  # the child: exit status says whether the shared product was right
        ok = all(torch.equal(L.linear(x, wp, 8192, panels_per_task=1), want) for _ in range(20))
        os._exit(0 if ok and step.pool_stats()["shared_calls"] == 20 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
