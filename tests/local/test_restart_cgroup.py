"""A worker restarted by `pdcluster up` goes back into the cgroups its predecessor was moved into (a CPU limit
set from outside, as the ratio sweep does), instead of silently running unlimited in `up`'s own."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from pdcluster.worker.local import cgroups as cg
from pdcluster.worker.local.supervisor import Supervisor

MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 /kubepods /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
OWN = "9:name=systemd:/\n4:memory:/\n1:cpu,cpuacct:/\n0::/kubepods\n"


def test_only_the_hierarchies_the_child_was_moved_in_are_rejoined() -> None:
    child = cg.parse_placement("9:name=systemd:/\n4:memory:/\n1:cpu,cpuacct:/bench-1/decode-18602\n0::/kubepods\n")
    dirs = cg.moved_dirs(child, cg.parse_placement(OWN), cg.parse_mounts(MOUNTINFO))
    assert dirs == [Path("/sys/fs/cgroup/cpu,cpuacct/bench-1/decode-18602")]


def test_a_cgroup2_path_is_taken_relative_to_the_mounted_root_and_options_are_not_controllers() -> None:
    child = cg.parse_placement("9:name=systemd:/x\n0::/kubepods/pod-1\n")
    dirs = cg.moved_dirs(child, cg.parse_placement(OWN), cg.parse_mounts(MOUNTINFO))
    assert dirs == [Path("/sys/fs/cgroup/unified/pod-1"), Path("/sys/fs/cgroup/systemd/x")]
    outside = cg.parse_placement("0::/elsewhere\n")  # not under the mounted /kubepods: nothing to write to
    assert cg.moved_dirs(outside, cg.parse_placement(OWN), cg.parse_mounts(MOUNTINFO)) == []


def test_an_exiting_child_reads_as_the_root_of_every_hierarchy_and_that_is_not_a_placement() -> None:
    # seen on this box: a SIGKILLed worker not yet reaped shows "/" everywhere, memory included, where up sits
    # in /process_api/...: taken at face value, the restart joined the memory root and lost the CPU limit
    exiting = cg.parse_placement("9:name=systemd:/\n4:memory:/\n1:cpu,cpuacct:/\n0::/\n")
    own = cg.parse_placement("9:name=systemd:/\n4:memory:/process_api/1\n1:cpu,cpuacct:/\n0::/kubepods\n")
    assert cg.moved_dirs(exiting, own, cg.parse_mounts(MOUNTINFO)) == []


def test_same_placement_or_unreadable_child_means_nothing_to_rejoin(tmp_path: Path) -> None:
    assert cg.moved_dirs(cg.parse_placement(OWN), cg.parse_placement(OWN), cg.parse_mounts(MOUNTINFO)) == []
    assert cg.Placement(tmp_path).dirs_of(12345) is None  # gone: the last placement read is kept


def test_join_skips_a_group_removed_since(tmp_path: Path) -> None:
    live = tmp_path / "g"
    live.mkdir()
    cg.join([tmp_path / "removed", live])
    assert (live / "cgroup.procs").read_text() == str(os.getpid())


class FakePlacement(cg.Placement):
    """Every child sits in `dirs` (as if moved there by a benchmark), whatever /proc says."""

    def __init__(self, dirs: list[Path]) -> None:
        super().__init__()
        self.dirs = dirs

    def dirs_of(self, pid: int) -> list[Path] | None:
        return list(self.dirs)


def _restart(sup: Supervisor, name: str) -> tuple[int, int, list[str]]:
    p = sup.procs[name]
    first = p.pid
    assert first is not None
    events = sup.poll()  # sees it alive: notes where it sits
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while p.pid == first and time.monotonic() < deadline:
        events += sup.poll()
        time.sleep(0.05)
    assert p.pid is not None and p.pid != first
    return first, p.pid, events


def test_a_restarted_child_writes_itself_into_its_predecessors_groups(tmp_path: Path) -> None:
    group = tmp_path / "cpu" / "decode-18602"
    group.mkdir(parents=True)
    sup = Supervisor(tmp_path / "logs", placement=FakePlacement([group]))
    try:
        sup.add("decode-0", [sys.executable, "-c", "import time; time.sleep(60)"])
        _, second, events = _restart(sup, "decode-0")
        assert (group / "cgroup.procs").read_text() == str(second)  # written by the new child before exec
        assert any(f"in its cgroups {group}" in e for e in events)
    finally:
        sup.stop(timeout=5)


def _cpu_v1_writable() -> Path | None:
    root = Path("/sys/fs/cgroup/cpu")
    if os.geteuid() != 0 or not (root / "cpu.cfs_quota_us").is_file():
        return None
    return root


@pytest.mark.skipif(_cpu_v1_writable() is None, reason="needs root and a cgroup v1 cpu controller")
def test_a_real_cpu_limit_survives_a_restart(tmp_path: Path) -> None:
    root = _cpu_v1_writable()
    assert root is not None
    group = root / f"pdcluster-test-restart-{os.getpid()}"
    group.mkdir()
    sup = Supervisor(tmp_path)
    try:
        (group / "cpu.cfs_quota_us").write_text("40000")
        p = sup.add("decode-0", [sys.executable, "-c", "import time; time.sleep(60)"])
        (group / "cgroup.procs").write_text(str(p.pid))  # what benchmarks/local_stack.confine does
        _, second, _ = _restart(sup, "decode-0")
        assert str(second) in (group / "cgroup.procs").read_text().split()
    finally:
        sup.stop(timeout=5)
        home = root / cg.parse_placement(Path("/proc/self/cgroup").read_text()).get(frozenset({"cpu"}), "/").lstrip("/")
        for pid in (group / "cgroup.procs").read_text().split():
            (home / "cgroup.procs").write_text(pid)
        group.rmdir()


def test_up_gives_up_after_start_timeout_and_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The start deadline was a hard-coded 180 s; a CPU-limited worker on a busy box can need more."""
    import socket

    from pdcluster.cli import main

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # never loads: the workers cannot be ready in 0.5 s anyway
    for _ in range(5):  # the router's port and the two after it must be free: another try if one was not
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        t0 = time.monotonic()
        rc = main(["up", "--model", str(model), "--port", str(port), "--start-timeout", "0.5"])
        err = capsys.readouterr().err
        if "in use" not in err:
            break
    assert rc == 1 and time.monotonic() - t0 < 60, err
    assert "within 0.5 s (--start-timeout)" in err and f"127.0.0.1:{port}" in err, err


class ExitingPlacement(FakePlacement):
    """In its group while alive; then, killed but not yet reaped, the child reads as the root cgroup."""

    def __init__(self, dirs: list[Path]) -> None:
        super().__init__(dirs)
        self.exiting = False

    def dirs_of(self, pid: int) -> list[Path] | None:
        return [] if self.exiting else list(self.dirs)


def test_a_read_during_the_childs_exit_does_not_forget_its_group(tmp_path: Path) -> None:
    """The real-cgroup test failed 1 run in 3: a poll between the SIGKILL and the reaping read the exiting
    task's placement as the root cgroup and the restart went to `up`'s own."""
    group = tmp_path / "decode-18602"
    group.mkdir()
    place = ExitingPlacement([group])
    sup = Supervisor(tmp_path / "logs", placement=place)
    try:
        p = sup.add("decode-0", [sys.executable, "-c", "import time; time.sleep(60)"])
        sup.poll()
        place.exiting = True
        sup.poll()  # still alive by popen's account, in its exit by /proc's
        first = p.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while p.pid == first and time.monotonic() < deadline:
            sup.poll()
            time.sleep(0.05)
        assert (group / "cgroup.procs").read_text() == str(p.pid)
    finally:
        sup.stop(timeout=5)
