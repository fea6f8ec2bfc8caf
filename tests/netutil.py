"""Loopback server helpers shared by the suites that run real HTTP (server, disagg)."""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn


def free_port() -> int:
    """A free loopback port below the ephemeral range. The caller binds it later, often in another process;
    a port the kernel handed out as ephemeral can be taken meanwhile by any socket opened without a port (a
    NIXL agent's UCX listener took a decode worker's HTTP port in one CI run)."""
    return free_block(1)


_given: set[int] = set()  # ports this process has handed out (free when checked, perhaps not yet bound)


def _slice(low: int) -> tuple[int, int]:
    """This pytest-xdist worker's share of the 8,000 ports below the ephemeral range (all of it without xdist)."""
    lo, hi = max(1024, low - 8000), low
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1:
        span = (hi - lo) // int(count)
        lo += int(worker[2:]) % int(count) * span
        hi = lo + span
    return lo, hi


def free_block(n: int) -> int:
    """A port p with p .. p+n-1 all free (`up` puts the router on p and the workers after it), below the
    kernel's ephemeral range: a block inside it can be taken between this check and `up`'s binds by any
    socket the stack opens meanwhile (a worker's UCX listener took decode-1's port in one CI run).

    A port is checked free, then bound later by another process, so nothing stops a second draw from
    returning it meanwhile: a TP 2 prefill worker's KV block and the decode worker's HTTP port, drawn one
    after the other in one test, or two xdist workers' draws (`[Errno 98] address already in use` on a
    worker's HTTP port in one `make test`). So no port is handed out twice by this process, and each xdist
    worker draws from its own slice of the range."""
    from pdcluster.worker.local.launcher import port_in_use

    lo, hi = _slice(int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]))
    if len(_given) > (hi - lo) // 2:  # a long session: the servers of the first draws are long gone
        _given.clear()
    rng = random.Random()
    while True:
        p = rng.randrange(lo, hi - n)
        block = range(p, p + n)
        if not _given.intersection(block) and not any(port_in_use("127.0.0.1", q) for q in block):
            _given.update(block)
            return p


@contextlib.contextmanager
def serve(app: Any, startup_timeout: float = 30.0) -> Iterator[str]:
    """Run an ASGI app under uvicorn in a thread on a free loopback port; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
