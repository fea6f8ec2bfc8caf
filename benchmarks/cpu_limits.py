"""Per-process CPU limits for the benchmark stacks, with the cgroup v1 `cpu` controller: what a Kubernetes
pod's `resources.limits.cpu` does (CFS quota per period), emulated for the workers of one `pdcluster up`.

Why: on the shared 2-core dev box the workers of a P:D split compete for the same cores, so a busy prefill
pool takes CPU from the decode worker and the split's decode latency says more about the scheduler than about
the split. The planner's formula assumes independent instances (each pod its own device or CPU limit); a
quota per worker process gives each one a fixed share that its neighbours cannot take.

Pure parts: quota arithmetic (`quota_us`, `check_budget`), which processes are whose (`classify`,
`descendants`), `cpu.stat` parsing. The edge: `CpuGroups` creates one cgroup per name under a parent of its
own, moves processes in (`cgroup.procs` moves every thread; children forked later inherit the group) and
removes every group it created on close, moving any task still inside back to the caller's own cgroup first.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

CPU_ROOT = Path("/sys/fs/cgroup/cpu")  # cgroup v1, the `cpu` controller (on some hosts `cpu,cpuacct`)
PERIOD_US = 100_000  # the kernel's and Kubernetes' default CFS period
MIN_QUOTA_US = 1_000  # the kernel refuses a quota under 1 ms


class CgroupError(RuntimeError):
    """The cgroup fs cannot do what was asked (not mounted, not writable, a group not removable)."""


def quota_us(cpus: float, period_us: int = PERIOD_US) -> int:
    """cpu.cfs_quota_us for a limit of `cpus` CPUs (0.4 -> 40,000 per 100,000 us period)."""
    if not cpus > 0:
        raise ValueError(f"a CPU limit must be > 0 (got {cpus})")
    q = round(cpus * period_us)
    if q < MIN_QUOTA_US:
        raise ValueError(f"a CPU limit of {cpus} is under the kernel's minimum quota ({MIN_QUOTA_US} us per "
                         f"{period_us} us period)")
    return q


def check_budget(worker_cpu: float, workers: int, router_cpu: float, cores: int) -> None:
    """Refuse limits whose sum exceeds the cores: then the limits would not be guarantees, and the split
    would again depend on who the scheduler favours."""
    total = worker_cpu * workers + router_cpu
    if total > cores + 1e-9:
        raise ValueError(f"{workers} workers x {worker_cpu} CPU + router {router_cpu} CPU = {total:.2f} CPU is "
                         f"more than the {cores} cores here; lower --worker-cpu/--router-cpu")


def classify(argv: list[str]) -> str | None:
    """The group a process of `pdcluster up` belongs to, from its command line: 'router', '<role>-<port>'
    for a worker (`pdcluster serve --role R --port N`), None for anything else."""
    if "pdcluster" not in argv:
        return None
    rest = argv[argv.index("pdcluster") + 1:]
    if rest[:1] == ["router"]:
        return "router"
    if rest[:1] == ["serve"]:
        def flag(name: str, default: str) -> str:
            return rest[rest.index(name) + 1] if name in rest[:-1] else default

        return f"{flag('--role', 'both')}-{flag('--port', '?')}"
    return None


def descendants(parents: Mapping[int, int], root: int) -> list[int]:
    """Every process below `root` (children, grandchildren, ...) in a pid -> ppid table, nearest first."""
    kids: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        kids.setdefault(ppid, []).append(pid)
    out: list[int] = []
    todo = sorted(kids.get(root, []))
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(sorted(kids.get(pid, [])))
    return out


def assign(table: Mapping[int, tuple[int, list[str]]], root: int) -> dict[int, str]:
    """pid -> group for every process below `root` that is a router or worker, or a descendant of one
    (a worker's own children share its limit, as a pod's processes share the pod's)."""
    out: dict[int, str] = {}
    for pid in descendants({p: pp for p, (pp, _) in table.items()}, root):  # parents before their children
        ppid, argv = table[pid]
        name = out.get(ppid) or classify(argv)
        if name:
            out[pid] = name
    return out


def parse_cpu_stat(text: str) -> dict[str, int]:
    """cpu.stat: nr_periods, nr_throttled, throttled_time (ns), as ints."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if v.strip().isdigit():
            out[k] = int(v)
    return out


def throttled_share(stat: Mapping[str, int]) -> float | None:
    """The share of CFS periods in which the group ran out of quota (None before it ran at all)."""
    n = stat.get("nr_periods", 0)
    return stat.get("nr_throttled", 0) / n if n else None


def stat_cpu_ticks(stat: str) -> int:
    """utime + stime (clock ticks, all threads) from a /proc/PID/stat line."""
    f = stat[stat.rindex(")") + 2:].split()  # fields from the 3rd on: state is f[0], utime the 14th field
    return int(f[11]) + int(f[12])


def cpu_seconds(pids: Iterable[int], proc: Path = Path("/proc")) -> float:
    """CPU seconds the processes have used so far (those that exited meanwhile count 0)."""
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            ticks += stat_cpu_ticks((proc / str(pid) / "stat").read_text())
    return ticks / os.sysconf("SC_CLK_TCK")


def process_table(proc: Path = Path("/proc")) -> dict[int, tuple[int, list[str]]]:
    """pid -> (ppid, argv) of every process readable now (processes that exit meanwhile are skipped)."""
    out: dict[int, tuple[int, list[str]]] = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # stat is "pid (comm) state ppid ...": comm may hold spaces and parentheses, so cut at the last ')'.
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        out[int(d.name)] = (ppid, [a.decode(errors="replace") for a in argv if a])
    return out


def own_cgroup(root: Path = CPU_ROOT) -> Path:
    """The cpu cgroup this process is in (where tasks go back to before a group is removed)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        if "cpu" in ctrls.split(","):
            return root / path.lstrip("/")
    return root


def stale(names: Iterable[str], prefix: str, alive: Callable[[int], bool]) -> list[str]:
    """Parents `<prefix>-<pid>-<n>` whose creator is gone (killed with SIGKILL, so its close() never ran)."""
    out = []
    for n in names:
        pid = n[len(prefix) + 1:].split("-")[0] if n.startswith(prefix + "-") else ""
        if pid.isdigit() and not alive(int(pid)):
            out.append(n)
    return out


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _remove_tree(g: Path, home: Path) -> bool:
    """Removes `g` and its child groups (tasks inside go to `home` first); False when one would not go."""
    for sub in sorted((p for p in g.iterdir() if p.is_dir()), reverse=True):
        if not _remove_tree(sub, home):
            return False
    for _ in range(50):  # a task may be exiting, or a child forked while we moved it: a few tries
        for pid in (g / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                (home / "cgroup.procs").write_text(pid)
        try:
            g.rmdir()
            return True
        except OSError:
            time.sleep(0.1)
    return False


def remove_stale(root: Path, prefix: str, home: Path) -> None:
    for name in stale((p.name for p in root.iterdir() if p.is_dir()), prefix, _alive):
        _remove_tree(root / name, home)


class CpuGroups:
    """Cgroups under one parent `<root>/<prefix>-<pid>-<n>`, removed (with the parent) by close(); use it as a
    context manager so they go even on an exception or Ctrl-C."""

    _count = 0

    def __init__(self, prefix: str = "pdcluster-bench", root: Path = CPU_ROOT, period_us: int = PERIOD_US) -> None:
        if not (root / "cgroup.procs").is_file() or not (root / "cpu.cfs_quota_us").is_file():
            raise CgroupError(f"no cgroup v1 cpu controller at {root} (cpu.cfs_quota_us missing): CPU limits per "
                              "worker need a cgroup v1 host; pass --worker-cpu 0 to run without them")
        CpuGroups._count += 1
        self.root, self.period_us = root, period_us
        self.home = own_cgroup(root)
        remove_stale(root, prefix, self.home)
        self.parent = root / f"{prefix}-{os.getpid()}-{CpuGroups._count}"
        try:
            self.parent.mkdir()
        except OSError as e:
            raise CgroupError(f"cannot create {self.parent} ({e.strerror}): CPU limits per worker need a writable "
                              "cgroup v1 cpu controller (root); pass --worker-cpu 0 to run without them") from e
        self.groups: dict[str, Path] = {}

    def limit(self, name: str, cpus: float) -> Path:
        """The group `name` (created on first use) limited to `cpus` CPUs."""
        g = self.groups.get(name)
        if g is None:
            g = self.parent / name
            g.mkdir()
            self.groups[name] = g
        (g / "cpu.cfs_period_us").write_text(str(self.period_us))
        (g / "cpu.cfs_quota_us").write_text(str(quota_us(cpus, self.period_us)))
        return g

    def move(self, name: str, pids: Iterable[int]) -> list[int]:
        """Moves each process (all its threads) into the group; returns those moved (gone ones are skipped)."""
        moved = []
        for pid in pids:
            try:
                (self.groups[name] / "cgroup.procs").write_text(str(pid))
                moved.append(pid)
            except ProcessLookupError:
                continue
        return moved

    def pids(self, name: str) -> list[int]:
        return [int(x) for x in (self.groups[name] / "cgroup.procs").read_text().split()]

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by each group's processes (the cores it got = the change / wall time)."""
        return {name: cpu_seconds(self.pids(name)) for name in self.groups}

    def stat(self, name: str) -> dict[str, int]:
        return parse_cpu_stat((self.groups[name] / "cpu.stat").read_text())

    def close(self) -> None:
        """Removes every group (tasks still inside go back to our own cgroup first), then the parent."""
        self.groups.clear()
        if self.parent.exists() and not _remove_tree(self.parent, self.home):
            raise CgroupError(f"could not remove cgroup {self.parent} (or a group under it)")

    def __enter__(self) -> CpuGroups:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
