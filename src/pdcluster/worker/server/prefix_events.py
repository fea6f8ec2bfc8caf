"""GET /internal/prefix-events: what this worker's prefix cache evicted, for the router's prefix index.

The router guesses which prompt blocks each worker holds from what it sent there; the engine's LRU evicts
blocks the router never hears about, so without this report the router keeps sending a prefix to a worker
that lost it. The router polls `?epoch=E&since=N` (the last report's values) and gets the block hashes
evicted after eviction N and not cached again since; without them, or when they no longer apply (a
restarted worker, a reader that fell behind the bounded log), it gets the whole resident set instead.
Authenticated like every /internal/* route (the bearer token derived from the shared secret).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from pdcluster.worker.api import errors
from pdcluster.worker.transfer.secret import check_internal_auth

MAX_SINCE = 1 << 62  # a sequence number beyond any real one: bigger is nonsense, not a position


def parse_query(epoch: str | None, since: str | None) -> tuple[str | None, int | None]:
    """(epoch, since) from the query string; a bad `since` is a 400 naming it (never a 422/500)."""
    if since is None:
        return epoch, None
    try:
        n = int(since)
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_SINCE:
        raise errors.bad_request(f"since must be an integer in [0, {MAX_SINCE}] (got {since[:40]!r})",
                                 param="since")
    if epoch is not None and (len(epoch) > 64 or not epoch.isalnum()):
        raise errors.bad_request("epoch must be the alphanumeric epoch of a previous report", param="epoch")
    return epoch, n


def prefix_events_router(engine: Any, secret: bytes | None) -> APIRouter:
    """The route over an AsyncEngine: the report is built on the engine thread, between two steps (the block
    manager is not thread-safe)."""

    async def authenticate(request: Request) -> None:
        if not check_internal_auth(secret, request.headers.get("authorization")):
            raise errors.APIError(401, "missing or invalid internal authentication token",
                                  type="authentication_error", code="invalid_internal_token",
                                  headers={"WWW-Authenticate": "Bearer"})

    r = APIRouter(prefix="/internal", dependencies=[Depends(authenticate)])

    @r.get("/prefix-events")
    async def prefix_events(request: Request) -> JSONResponse:
        epoch, since = parse_query(request.query_params.get("epoch"), request.query_params.get("since"))
        report = await engine.call(lambda e: e.block_manager.prefix_report(epoch, since))
        return JSONResponse(report)

    return r
