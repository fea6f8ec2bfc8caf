"""`up`'s supervisor takes a dead child's process group with it: a vLLM server killed by a signal leaves its
engine-core process running (seen on this box: orphans of ~2 GiB each after a killed `up --engine vllm`).
The grandchild here holds a FIFO open for writing; its end is the EOF the test reads, so the test waits on
that event, with a bound only for the failure."""
from __future__ import annotations

import os
import select
import sys
from pathlib import Path

from pdcluster.worker.local.supervisor import Supervisor

GRANDCHILD = ("import sys, time; f = open(sys.argv[1], 'w'); f.write('ready\\n'); f.flush(); "
              "print('up', flush=True); time.sleep(3600)")
# the child starts the grandchild in its own process group, waits until it holds the FIFO, and exits
CHILD = ("import subprocess, sys; "
         "g = subprocess.Popen([sys.executable, '-c', sys.argv[2], sys.argv[1]], stdout=subprocess.PIPE); "
         "g.stdout.readline(); sys.exit(3)")


def _read_line(fd: int, bound_s: float) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], bound_s)
        assert ready, "the grandchild never wrote"
        chunk = os.read(fd, 64)
        assert chunk, "the grandchild closed the FIFO before writing"
        data += chunk
    return data


def test_dead_childs_group_is_killed(tmp_path: Path) -> None:
    fifo = tmp_path / "held"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # opened before any writer: the EOF below is the writer's death
    try:
        sup = Supervisor(tmp_path / "logs", restart=False)
        proc = sup.add("worker", [sys.executable, "-c", CHILD, str(fifo), GRANDCHILD])
        assert _read_line(fd, 120) == b"ready\n"
        assert proc.popen is not None
        assert proc.popen.wait(120) == 3
        sup.poll()  # notices the exit: the group goes with it
        ready, _, _ = select.select([fd], [], [], 120)
        assert ready and os.read(fd, 64) == b"", "the grandchild outlived its parent's exit"
    finally:
        os.close(fd)
