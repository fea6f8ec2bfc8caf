"""CPU limits per benchmark process (benchmarks/cpu_limits.py): the quota arithmetic and which process goes where
(pure), and the cgroup v1 edge for real: create a group, move a child in, see it throttled, remove it all."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import cpu_limits as cl


def test_quota_is_the_limit_times_the_period():
    assert cl.quota_us(0.4) == 40_000
    assert cl.quota_us(1.5) == 150_000
    assert cl.quota_us(0.25, period_us=50_000) == 12_500
    for bad in (0, -1, 0.005):  # 0.005 CPU = 500 us: under the kernel's 1 ms minimum
        with pytest.raises(ValueError):
            cl.quota_us(bad)


def test_budget_refuses_limits_that_overbook_the_cores():
    cl.check_budget(0.4, 4, 0.4, 2)  # 2.0 of 2: the sweep's default fits
    with pytest.raises(ValueError, match="more than the 2 cores"):
        cl.check_budget(0.5, 4, 0.4, 2)


def test_classify_router_workers_and_others():
    py = [sys.executable, "-m", "pdcluster"]
    assert cl.classify([*py, "router", "--port", "18600"]) == "router"
    assert cl.classify([*py, "serve", "--model", "m", "--role", "decode", "--port", "18603"]) == "decode-18603"
    assert cl.classify([*py, "serve", "--port", "9"]) == "both-9"
    assert cl.classify([*py, "up", "--prefill", "1"]) is None  # the launcher itself stays unlimited
    assert cl.classify(["sleep", "10"]) is None


def test_assign_puts_workers_children_in_their_workers_group():
    py = [sys.executable, "-m", "pdcluster"]
    table = {
        10: (1, [*py, "up"]),
        11: (10, [*py, "serve", "--role", "prefill", "--port", "2"]),
        12: (10, [*py, "serve", "--role", "decode", "--port", "3"]),
        13: (10, [*py, "router", "--port", "1"]),
        14: (12, ["python", "-c", "helper"]),  # a worker's child: the worker's limit, like a pod's processes
        15: (14, ["grandchild"]),
        16: (10, ["unrelated"]),  # a child of `up` that is none of them
        20: (1, [*py, "serve", "--role", "decode", "--port", "4"]),  # another stack's worker: not ours
    }
    assert cl.assign(table, 10) == {11: "prefill-2", 12: "decode-3", 13: "router", 14: "decode-3",
                                    15: "decode-3"}
    assert cl.descendants({p: pp for p, (pp, _) in table.items()}, 12) == [14, 15]


def test_cpu_ticks_from_a_proc_stat_line_whose_name_has_spaces_and_parens():
    line = "4242 (we ird) (x)) R 1 4242 4242 0 -1 4194304 100 0 0 0 250 31 0 0 20 0 1 0 99 0 0"
    assert cl.stat_cpu_ticks(line) == 281  # utime 250 + stime 31


def test_cpu_stat_parsing_and_throttled_share():
    st = cl.parse_cpu_stat("nr_periods 200\nnr_throttled 50\nthrottled_time 123456\n")
    assert st == {"nr_periods": 200, "nr_throttled": 50, "throttled_time": 123456}
    assert cl.throttled_share(st) == 0.25
    assert cl.throttled_share({"nr_periods": 0}) is None


def test_process_table_reads_our_own_child():
    child = subprocess.Popen(["sleep", "30"])
    try:
        # Popen returns after the fork, maybe before the exec: until then the child's cmdline is ours
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/cmdline").read_bytes() != b"sleep\x0030\x00" and time.monotonic() < deadline:
            time.sleep(0.01)
        table = cl.process_table()
        assert table[child.pid] == (os.getpid(), ["sleep", "30"])
    finally:
        child.kill()
        child.wait()


def test_a_host_without_the_cpu_controller_is_a_clear_error(tmp_path: Path):
    with pytest.raises(cl.CgroupError, match="no cgroup v1 cpu controller"):
        cl.CpuGroups(root=tmp_path)


def _writable_cpu_cgroup() -> bool:
    try:
        cl.CpuGroups(prefix="pdcluster-probe").close()
        return True
    except cl.CgroupError:
        return False


@pytest.mark.skipif(not _writable_cpu_cgroup(), reason="needs a writable cgroup v1 cpu controller (root)")
def test_real_group_limits_a_child_and_is_removed():
    busy = "import time\nt = time.time()\nwhile time.time() - t < 30: pass"
    sleeper = subprocess.Popen(["sleep", "30"])
    spinner = subprocess.Popen([sys.executable, "-c", busy])
    groups = cl.CpuGroups(prefix="pdcluster-test")
    parent = groups.parent
    started = time.time()
    try:
        g = groups.limit("w", 0.1)
        assert (g / "cpu.cfs_quota_us").read_text().strip() == "10000"
        assert groups.move("w", [sleeper.pid, spinner.pid]) == [sleeper.pid, spinner.pid]
        assert sorted(groups.pids("w")) == sorted([sleeper.pid, spinner.pid])
        cpu_line = [ln for ln in Path(f"/proc/{sleeper.pid}/cgroup").read_text().splitlines()
                    if "cpu" in ln.split(":")[1].split(",")][0]
        assert cpu_line.endswith(f"/{parent.name}/w")
        time.sleep(1.0)  # the spinner wants a whole CPU and gets 10 ms per 100 ms: throttled nearly every period
        st = groups.stat("w")
        assert st["nr_periods"] >= 5 and cl.throttled_share(st) > 0.5
        used = groups.cpu_seconds()["w"]  # ~0.1 s per second in the group; never more than the quota allows
        assert 0 < used < 0.1 * (time.time() - started) + 0.5
    finally:
        groups.close()  # both processes still run: close moves them out before removing the groups
        sleeper.kill()
        spinner.kill()
        sleeper.wait()
        spinner.wait()
    assert not parent.exists()
    assert not list(cl.CPU_ROOT.glob("pdcluster-test-*"))


def test_stale_parents_are_those_whose_creator_is_gone():
    names = ["pdcluster-bench-100-1", "pdcluster-bench-200-3", "pdcluster-bench-x-1", "other-100-1",
             "pdcluster-bench-100"]
    assert cl.stale(names, "pdcluster-bench", lambda pid: pid == 200) == ["pdcluster-bench-100-1",
                                                                          "pdcluster-bench-100"]


FAKE_UP = '''
import signal, subprocess, sys, time
kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "pdcluster", *a]) for a in
        (["serve", "--role", "prefill", "--port", "1"], ["serve", "--role", "decode", "--port", "2"], ["router"])]
def bye(*_):
    for k in kids:
        k.kill()
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
time.sleep(60)
'''


@pytest.mark.skipif(not _writable_cpu_cgroup(), reason="needs a writable cgroup v1 cpu controller (root)")
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_stack_processes_are_limited_and_groups_removed_on_error(tmp_path, monkeypatch, error):
    """local_stack.up with a stand-in for `pdcluster up` (a process that starts a 'prefill', a 'decode' and a
    'router' child): each lands in its own limited group; an error in the run (Ctrl-C included) removes them."""
    from benchmarks import local_stack

    fake = tmp_path / "fake_up.py"
    fake.write_text(FAKE_UP)
    monkeypatch.setattr(local_stack, "PDCLUSTER", [sys.executable, str(fake)])
    monkeypatch.setattr(local_stack, "healthy", lambda view: (1, 1))
    mine = f"pdcluster-bench-{os.getpid()}-*"  # not another run's (a sweep may be running beside the tests)
    before = set(cl.CPU_ROOT.glob(mine))
    seen: dict[str, list[int]] = {}
    use = local_stack.Usage()
    with pytest.raises(error):
        with local_stack.up([], 1, tmp_path / "up.log", (1, 1), cpu=local_stack.CpuLimit(0.3, 0.2), usage=use):
            assert sorted(use.cpu_seconds()) == ["decode-2", "prefill-1", "router"]
            (parent,) = set(cl.CPU_ROOT.glob(mine)) - before
            for g in parent.iterdir():
                if g.is_dir():
                    seen[g.name] = [int(x) for x in (g / "cgroup.procs").read_text().split()]
                    seen[g.name + " quota"] = [int((g / "cpu.cfs_quota_us").read_text())]
            raise error()
    assert sorted(k for k in seen if "quota" not in k) == ["decode-2", "prefill-1", "router"]
    assert all(len(seen[k]) == 1 for k in ("decode-2", "prefill-1", "router"))
    assert seen["prefill-1 quota"] == [30_000] and seen["router quota"] == [20_000]
    assert set(cl.CPU_ROOT.glob(mine)) == before  # nothing left behind


@pytest.mark.skipif(not _writable_cpu_cgroup(), reason="needs a writable cgroup v1 cpu controller (root)")
def test_a_stack_that_never_starts_is_a_start_error_and_leaves_no_group(tmp_path, monkeypatch):
    from benchmarks import local_stack

    fake = tmp_path / "fake_up.py"
    fake.write_text("import sys, time\ntime.sleep(0.3)\nsys.exit(1)\n")  # like `up` past its 180 s deadline
    monkeypatch.setattr(local_stack, "PDCLUSTER", [sys.executable, str(fake)])
    monkeypatch.setattr(local_stack, "confine", lambda *a, **k: None)
    mine = f"pdcluster-bench-{os.getpid()}-*"
    before = set(cl.CPU_ROOT.glob(mine))
    with pytest.raises(local_stack.StartError, match="exited with 1"):
        with local_stack.up([], 1, tmp_path / "up.log", (1, 1), cpu=local_stack.CpuLimit(0.3, 0.2)):
            pass
    assert set(cl.CPU_ROOT.glob(mine)) == before
