"""A role flip: `POST /internal/role {"role": "prefill"|"decode"}` moves a running worker to the other pool
without a restart (docs/operator.md, "Role flips").

The engine does not depend on the role (one KV block pool serves prompts, imports and decode steps alike), so
a flip keeps the weights and the KV cache (and its prefix cache) and changes what the role names:

1. the worker stops admitting new work (`draining`: /health and /internal/load say not ready, so the router
   and the Services stop sending it any);
2. it finishes what it holds: its streams (`in_flight`), the prefill requests whose KV is still on its way to
   a decode worker (no KV is stranded), and the reservations waiting for their KV (a decode worker's imports);
3. it takes the new role and the new pool's batch limits (`max_batch_size`, `max_batch_tokens`, optional;
   the scheduler reads them at every step, and the KV cache, sized at start, is shared by both roles): /health, /internal/load and every metric series say it (the old role's series
   end; the new one's start from zero), then it admits work again.

Idempotent: asking for the role the worker has answers at once (`changed: false`); a second call for the same
flip waits on the one in progress; a call for the other role meanwhile is a 409. A worker that still holds
work after `timeout_s` goes back to its old role, admitting again, and answers 503 `flip_timeout`: nothing
was moved, the caller may try again later. A draining worker (being scaled down) is not flipped (409).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from pdcluster.worker.api import errors
from pdcluster.worker.api.body import json_object, validate
from pdcluster.worker.server.lifecycle import WorkerServer, find_attr

if TYPE_CHECKING:
    from pdcluster.worker.server.internal_routes import Disaggregation

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode")
QUIET_CHECK_S = 0.02  # how often the worker looks at its own counters while it finishes what it holds


class RoleBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    role: Literal["prefill", "decode"]
    timeout_s: float = Field(default=120.0, gt=0, le=3600)  # how long it may take to finish what it holds
    # the new pool's batch limits (its --max-batch-size / --max-batch-tokens), set while the worker is idle
    max_batch_size: int | None = Field(default=None, ge=1, le=1024)
    max_batch_tokens: int | None = Field(default=None, ge=1, le=1 << 20)


def holding(d: Disaggregation, w: WorkerServer) -> dict[str, int]:
    """What the worker still holds: streams, prefill KV not yet delivered, reservations awaiting their KV."""
    loads = len(d.connector.pending_loads()) if d.connector is not None else 0
    return {"in_flight": w.in_flight, "kv_saves": len(d.saving), "kv_loads": loads}


class RoleFlip:
    """The flip of one worker; at most one at a time."""

    def __init__(self, disagg: Disaggregation) -> None:
        self.d = disagg
        self.target: str | None = None
        self.task: asyncio.Task[dict[str, Any]] | None = None

    async def request(self, w: WorkerServer, role: str, timeout_s: float,
                      limits: dict[str, int] | None = None) -> dict[str, Any]:
        if self.task is not None and not self.task.done():
            if role != self.target:
                raise errors.APIError(409, f"a flip to {self.target} is in progress", code="flip_in_progress")
            return await asyncio.shield(self.task)  # a retried call waits on the same flip
        if role == w.role:
            return {"role": role, "previous": role, "changed": False, "seconds": 0.0}
        if w.draining:
            raise errors.APIError(409, "the worker is draining (being scaled down): not flipped", code="draining")
        if not w.ready:
            raise errors.unavailable("worker is not ready yet")
        self.target = role
        self.task = asyncio.ensure_future(self._flip(w, role, timeout_s, limits or {}))
        return await asyncio.shield(self.task)  # a caller that leaves does not abandon a half-done flip

    async def _flip(self, w: WorkerServer, role: str, timeout_s: float, limits: dict[str, int]) -> dict[str, Any]:
        old, t0 = w.role, time.monotonic()
        log.info("role flip %s -> %s: draining (%s)", old, role, holding(self.d, w))
        w.draining = True
        try:
            deadline = t0 + timeout_s
            while any(holding(self.d, w).values()):
                if time.monotonic() >= deadline:
                    held = holding(self.d, w)
                    log.warning("role flip %s -> %s abandoned after %.0f s: still holding %s", old, role,
                                timeout_s, held)
                    raise errors.APIError(503, f"still holding {held} after {timeout_s:g} s: the worker stays "
                                          f"{old}", code="flip_timeout", headers={"Retry-After": "5"})
                await asyncio.sleep(QUIET_CHECK_S)
            set_batch_limits(w.engine, limits)  # idle: no step is using them
            w.role = self.d.role = role
            w.metrics = w.metrics.with_role(role)
        finally:
            w.draining = False
        seconds = time.monotonic() - t0
        log.info("role flip %s -> %s done in %.2f s", old, role, seconds)
        return {"role": role, "previous": old, "changed": True, "seconds": seconds}


def set_batch_limits(engine: Any, limits: dict[str, int]) -> None:
    """The new pool's batch limits on the engine's scheduler (read at every step; the KV cache, sized at
    start, stays as it is)."""
    sched = find_attr(engine, "scheduler")
    config = find_attr(engine, "config")
    for name, value in limits.items():
        if sched is not None and hasattr(sched, name):
            setattr(sched, name, value)
        if config is not None and hasattr(config, name):
            setattr(config, name, value)


def add_role_route(r: APIRouter, disagg: Disaggregation) -> None:
    """Mount `POST /role` on the (authenticated) /internal router."""
    flip = RoleFlip(disagg)

    @r.post("/role")
    async def set_role(request: Request) -> JSONResponse:
        w: WorkerServer = request.app.state.worker
        data = validate(RoleBody, await json_object(request))
        limits = {k: v for k in ("max_batch_size", "max_batch_tokens") if (v := getattr(data, k)) is not None}
        return JSONResponse(await flip.request(w, data.role, data.timeout_s, limits))
