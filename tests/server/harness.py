"""Run an ASGI app under a real uvicorn server on a free loopback port, in a background thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve(app: Any, startup_timeout: float = 30.0) -> Iterator[str]:
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
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


def wait_until(pred: Any, timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Poll `pred` until true; tests assert on the result instead of sleeping a fixed time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


def raw_post(base_url: str, path: str, body: dict[str, Any]) -> socket.socket:
    """Send a JSON POST over a bare socket and return it unread, so a test can hang up at will."""
    import json
    from urllib.parse import urlsplit

    u = urlsplit(base_url)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((u.hostname or "127.0.0.1", u.port or 80))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock
