"""What the router's calls to workers can end in, and how a worker's streamed reply is read.

Errors are split by what the router does next: `WorkerFailed` (retry on another pair), `NoCapacity` (wait
and retry), `NoHealthyDecode` (wait, but at most `decode_wait`), `NoTransferPath` (prefill on the decode
worker), `UpstreamError` (the worker's own answer, passed to the client as it is).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx


class WorkerFailed(Exception):
    """A worker broke this attempt; another pair may succeed."""

    def __init__(self, role: str, url: str, message: str) -> None:
        super().__init__(f"{role} worker {url}: {message}")
        self.role, self.url = role, url


def describe(exc: BaseException) -> str:
    """An exception as a log/error line that is never empty: httpx's timeouts often carry no text, and an
    "attempt failed: " line with nothing after it tells an operator nothing."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class NoCapacity(Exception):
    """Every candidate refused for lack of room (429s, no KV blocks): wait and try again."""


class NoHealthyDecode(NoCapacity):
    """No decode worker is healthy right now (died, restarting, draining): wait, but only `decode_wait`."""


class NoTransferPath(Exception):
    """No decode worker can receive KV (e.g. `both` workers without a transfer secret): prefill there."""


class UpstreamError(Exception):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(str(body))
        self.status, self.body = status, body


async def read_lines(resp: httpx.Response, role: str, url: str) -> AsyncIterator[dict[str, Any]]:
    """A worker's NDJSON events; a line that is not a JSON object means that worker is broken."""
    async for line in resp.aiter_lines():
        if line.strip():
            try:
                ev = json.loads(line)
            except ValueError:
                raise WorkerFailed(role, url, f"garbled reply line {line[:80]!r}") from None
            if not isinstance(ev, dict):
                raise WorkerFailed(role, url, f"reply line is not an object: {line[:80]!r}")
            yield ev


async def error_of(resp: httpx.Response) -> UpstreamError:
    await resp.aread()
    try:
        body = resp.json()
    except ValueError:
        body = {"error": {"message": resp.text[:500], "type": "upstream_error", "code": None}}
    return UpstreamError(resp.status_code, body)


def no_decode_error(waited: float) -> UpstreamError:
    return UpstreamError(503, {"error": {
        "message": f"no healthy decode worker for {waited:.1f} s (died or draining and not back); retry later",
        "type": "server_error", "code": "no_decode_worker"}})
