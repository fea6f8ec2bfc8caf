"""Loopback server helpers shared by the suites that run real HTTP (server, disagg)."""

from __future__ import annotations

import contextlib
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


def free_block(n: int) -> int:
    """A port p with p .. p+n-1 all free (`up` puts the router on p and the workers after it), below the
    kernel's ephemeral range: a block inside it can be taken between this check and `up`'s binds by any
    socket the stack opens meanwhile (a worker's UCX listener took decode-1's port in one CI run)."""
    from pdcluster.worker.local.launcher import port_in_use

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    while True:
        p = rng.randrange(max(1024, low - 8000), low - n)
        if not any(port_in_use("127.0.0.1", p + i) for i in range(n)):
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
