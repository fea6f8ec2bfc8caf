"""Helpers for the server tests: real uvicorn on loopback (from tests/netutil.py), polling, raw sockets."""

from __future__ import annotations

import socket
import time
from typing import Any

from ..netutil import free_port, serve  # noqa: F401  (re-exported to the tests)


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


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of the first sample called `name` whose labels include `labels` (others may be present:
    workers add model_name, Kubernetes adds pdcluster), or None when there is none."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None
