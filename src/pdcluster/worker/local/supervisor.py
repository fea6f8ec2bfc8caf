"""Child processes for `pdcluster up`: start, watch, restart with backoff (like a Deployment would), and
stop cleanly. Children die with the launcher even if it is SIGKILLed (Linux PR_SET_PDEATHSIG).

Restarting cannot fix everything: a child that exits with a usage error (code 2: a bad flag) or keeps
failing soon after it starts (`max_restarts` times in a row, each within a minute) raises `CrashLoop` with
the tail of its log, so `up` stops with the child's own message instead of restarting it forever.

A child moved into other cgroups while it ran (a CPU limit set from outside, as benchmarks/cpu_limits.py does) is
restarted inside them (worker/local/cgroups.py): a restart must not silently lift a limit."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdcluster.worker.local import cgroups

log = logging.getLogger(__name__)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


USAGE_ERROR = 2  # argparse's and our CLIs' exit code for a bad command line
HEALTHY_AFTER = 60.0  # seconds of uptime after which a child counts as having started fine


class CrashLoop(Exception):
    """A child that restarting will not fix; the message ends with the tail of its log."""

    def __init__(self, name: str, code: int, message: str) -> None:
        super().__init__(message)
        self.name, self.code = name, code


def log_tail(path: Path, lines: int = 5) -> str:
    """The last non-empty lines of a log (where a child's own error message is)."""
    try:
        text = path.read_bytes()[-8192:].decode(errors="replace")
    except OSError:
        return ""
    return "\n".join([line.rstrip() for line in text.splitlines() if line.strip()][-lines:])


def backoff(restarts: int) -> float:
    """Seconds before restart number `restarts` (1, 2, 4 .. capped at 10), as kubelet's CrashLoopBackOff."""
    return float(min(10, 2 ** max(0, restarts - 1)))


@dataclass
class Proc:
    name: str
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    restart_at: float | None = None
    started_at: float = 0.0
    enabled: bool = True  # False: scaled down; not restarted
    drain_until: float | None = None  # SIGTERMed by a scale-down: killed if still alive at this time
    respawn: bool = False  # scaled up again while draining: start it once the old process has exited
    cgroups: list[Path] = field(default_factory=list)  # where the last process sat apart from `up`: rejoined

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


class Supervisor:
    def __init__(self, log_dir: Path, *, restart: bool = True, max_restarts: int = 5,
                 placement: cgroups.Placement | None = None) -> None:
        self.log_dir = log_dir
        self.placement = placement or cgroups.Placement()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, Proc] = {}
        self.restart = restart
        self.max_restarts = max_restarts  # quick failures in a row before giving up (CrashLoop)
        self.stopping = False

    def add(self, name: str, cmd: list[str], env: dict[str, str] | None = None, start: bool = True) -> Proc:
        p = Proc(name, cmd, env or {})
        self.procs[name] = p
        if start:
            self._spawn(p)
        return p

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def _spawn(self, p: Proc) -> None:
        out = open(self.log_path(p.name), "ab")  # noqa: SIM115 - the child owns it from here
        rejoin = list(p.cgroups)

        def in_child() -> None:  # between fork and exec: the new process is limited from its first instruction
            _die_with_parent()
            cgroups.join(rejoin)

        try:
            p.popen = subprocess.Popen(
                p.cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **p.env},
                start_new_session=True,  # Ctrl-C reaches only the launcher, which stops children in order
                preexec_fn=in_child,
            )
        finally:
            out.close()
        p.started_at, p.restart_at, p.enabled = time.monotonic(), None, True
        log.info("started %s (pid %d)", p.name, p.popen.pid)

    def poll(self) -> list[str]:
        """Notice exits and restart due processes; returns human-readable events. Raises CrashLoop for a
        child that restarting will not fix."""
        events: list[str] = []
        now = time.monotonic()
        for p in self.procs.values():
            if self.stopping or p.popen is None:
                continue
            if p.drain_until is not None:
                events += self._drain(p, now)
                continue
            if not p.enabled:
                continue
            code = p.popen.poll()
            if code is None:
                self._note_placement(p)
                if p.restart_at is None and now - p.started_at > HEALTHY_AFTER:
                    p.restarts = 0  # a minute of good health resets the backoff and the crash-loop count
                continue
            if p.restart_at is None:
                _kill_group(p.popen.pid)  # what the dead child started (vLLM's engine core) dies with it
                self._give_up_if_hopeless(p, code)
                p.restarts += 1
                p.restart_at = now + backoff(p.restarts)
                events.append(f"{p.name} exited with code {code}; restarting in {backoff(p.restarts):.0f} s "
                              f"(restart #{p.restarts}, log: {self.log_path(p.name)})")
            elif now >= p.restart_at and self.restart:
                self._spawn(p)
                where = f" in its cgroups {', '.join(map(str, p.cgroups))}" if p.cgroups else ""
                events.append(f"{p.name} restarted (pid {p.pid}){where}")
        return events

    def _note_placement(self, p: Proc) -> None:
        """Remembers where a live child sits (read every poll: a limit may be set on it at any time). A read
        that finds it nowhere special does not erase what was seen: a task already in its exit (killed, not yet
        reaped) reads as the root cgroup, and forgetting its group then was the race that lost the limit. A
        group removed since is skipped at the restart (`cgroups.join`)."""
        dirs = self.placement.dirs_of(p.pid) if p.pid is not None else None
        if dirs:
            p.cgroups = dirs

    def _give_up_if_hopeless(self, p: Proc, code: int) -> None:
        tail = log_tail(self.log_path(p.name))
        said = f"; its last words:\n{tail}" if tail else f" (log: {self.log_path(p.name)})"
        if code == USAGE_ERROR:  # the same command line fails the same way every time
            raise CrashLoop(p.name, code, f"{p.name} exited with a usage error (code {code}){said}")
        if p.restarts >= self.max_restarts:  # every try so far died within HEALTHY_AFTER of starting
            raise CrashLoop(p.name, code, f"{p.name} failed {p.restarts + 1} times in a row, each within "
                                          f"{HEALTHY_AFTER:.0f} s of starting (last exit code {code}){said}")

    def disable(self, name: str, timeout: float = 10.0) -> None:
        """Scale down: ask one process to drain (SIGTERM) and do not restart it. Returns at once, so `up`'s
        loop keeps serving its other duties while the worker finishes its requests; `poll` kills it if it
        is still alive after `timeout` seconds."""
        p = self.procs[name]
        p.enabled, p.respawn = False, False
        if p.alive and p.drain_until is None:
            with contextlib.suppress(ProcessLookupError):
                p.popen.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            p.drain_until = time.monotonic() + timeout

    def enable(self, name: str) -> None:
        """Scale up. A process still draining from a scale-down is replaced once it has exited (its port is
        still taken until then)."""
        p = self.procs[name]
        p.enabled = True
        if p.drain_until is not None:
            p.respawn = True
        elif not p.alive:
            self._spawn(p)

    def _drain(self, p: Proc, now: float) -> list[str]:
        assert p.popen is not None and p.drain_until is not None
        if p.popen.poll() is None:
            if now < p.drain_until:
                return []
            log.warning("%s did not drain in time: killing it", p.name)
            with contextlib.suppress(ProcessLookupError):
                p.popen.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(5)
        _kill_group(p.popen.pid)
        p.drain_until = None
        if not p.respawn:
            return [f"{p.name} stopped (scaled down)"]
        p.respawn = False
        self._spawn(p)
        return [f"{p.name} started again after draining (pid {p.pid})"]

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM everything (graceful: servers drain), SIGKILL what is still alive after `timeout`."""
        self.stopping = True
        self._terminate(list(self.procs.values()), timeout)

    @staticmethod
    def _terminate(procs: list[Proc], timeout: float) -> None:
        for p in procs:
            if p.alive:
                with contextlib.suppress(ProcessLookupError):
                    p.popen.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout
        for p in procs:
            if p.popen is None:
                continue
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s: killing it", p.name, timeout)
                with contextlib.suppress(ProcessLookupError):
                    p.popen.kill()
                p.popen.wait(5)
            _kill_group(p.popen.pid)


def _kill_group(pgid: int) -> None:
    """SIGKILL whatever is left of a child's process group once the child itself has exited. Each child leads
    its own group (`start_new_session`), and a vLLM server's engine-core process outlives a server killed by
    a signal (seen here: orphans holding ~2 GiB each); a pod's container takes them down with it, `up` does
    it here. The group id stays valid while any member lives, so this is a no-op once they are all gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
