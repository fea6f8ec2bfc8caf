"""Where a child of `pdcluster up` was placed in the cgroup tree, so its restart goes back there.

Why: a benchmark (benchmarks/cpu_limits.py) or an operator of the box may move a worker into a cgroup of its own
(a CPU limit, as a pod's `limits.cpu`). A restarted worker is a new process forked by `up`, and a new process
starts in its parent's cgroups: without this, the limit silently stopped applying after a crash. As a
kubelet restarts a container inside its pod's cgroup, `up` restarts a worker inside its predecessor's.

Pure parts: `parse_placement` (/proc/PID/cgroup), `parse_mounts` (/proc/self/mountinfo), `moved_dirs`
(the directories of the hierarchies where the child differs from `up` itself). The edge: `Placement` reads
them, and `join` (run in the new child between fork and exec) writes the child's pid into each directory.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path

Hierarchy = frozenset[str]  # a hierarchy's controllers ("cpu", "cpuacct", "name=systemd"); empty: cgroup v2


def parse_placement(text: str) -> dict[Hierarchy, str]:
    """/proc/PID/cgroup ("ID:controllers:/path" per line) -> hierarchy -> the process's path in it."""
    out: dict[Hierarchy, str] = {}
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) == 3:
            out[frozenset(c for c in parts[1].split(",") if c)] = parts[2]
    return out


def parse_mounts(mountinfo: str) -> dict[Hierarchy, tuple[str, Path]]:
    """/proc/self/mountinfo -> the mount's options (controllers among them; empty for cgroup2) -> (the cgroup
    path mounted, the mount point), for cgroup and cgroup2 mounts (the first mount of a hierarchy wins)."""
    out: dict[Hierarchy, tuple[str, Path]] = {}
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 3 or rest[0] not in ("cgroup", "cgroup2"):
            continue
        key: Hierarchy = frozenset() if rest[0] == "cgroup2" else frozenset(rest[2].split(","))
        out.setdefault(key, (fields[3], Path(fields[4])))
    return out


def moved_dirs(child: Mapping[Hierarchy, str], own: Mapping[Hierarchy, str],
               mounts: Mapping[Hierarchy, tuple[str, Path]]) -> list[Path]:
    """The cgroup directories of the hierarchies in which `child` sits elsewhere than `own` (the supervisor),
    the ones a restart must rejoin. A hierarchy not mounted here, or a path outside its mount, is skipped, and
    so is a root path: a task in its exit (killed, not yet reaped) reads as the root of every hierarchy, and
    no limit is ever set by moving a worker to the root."""
    out: list[Path] = []
    for key, path in sorted(child.items(), key=lambda kv: sorted(kv[0])):
        if path == "/":
            continue
        # a v1 mount's options hold its controllers among others (rw, xattr, ...); cgroup2 has the empty key
        mount = next((m for opts, m in mounts.items() if (opts >= key if key else not opts)), None)
        if own.get(key) == path or mount is None:
            continue
        root, point = mount
        rel = os.path.relpath(path, root) if root != "/" else path.lstrip("/")
        if rel.startswith(".."):
            continue
        out.append(point / rel if rel not in ("", ".") else point)
    return out


class Placement:
    """Reads placements from /proc (the paths are arguments so tests can point them elsewhere)."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self.proc = proc
        self._own: dict[Hierarchy, str] | None = None
        self._mounts: dict[Hierarchy, tuple[str, Path]] | None = None

    def _read(self, pid: int | str) -> dict[Hierarchy, str] | None:
        try:
            return parse_placement((self.proc / str(pid) / "cgroup").read_text())
        except OSError:  # gone, or no cgroups here
            return None

    def dirs_of(self, pid: int) -> list[Path] | None:
        """The directories `pid` sits in apart from ours; None when it cannot be read (it has exited)."""
        child = self._read(pid)
        if child is None:
            return None
        if self._own is None or self._mounts is None:
            self._own = self._read("self") or {}
            try:
                self._mounts = parse_mounts((self.proc / "self" / "mountinfo").read_text())
            except OSError:
                self._mounts = {}
        return moved_dirs(child, self._own, self._mounts)


def join(dirs: list[Path]) -> None:
    """Moves the calling process into each directory (run in the child before exec). A group removed since
    (its benchmark ended) is skipped: the child then runs where `up` does, as it would have without this."""
    pid = str(os.getpid())
    for d in dirs:
        with contextlib.suppress(OSError):
            (d / "cgroup.procs").write_text(pid)
