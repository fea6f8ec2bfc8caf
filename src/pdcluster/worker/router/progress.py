"""Where one request is in its journey: per-stage counts (the router's in-stage gauge) and the timeline of
phase boundaries that feeds pdcluster_request_phase_seconds and the request's trace."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from pdcluster.worker.api import tracing


class Timeline:
    """When one request reached each phase boundary at the router (time.monotonic()); `mark` observes the phase
    that just ended in pdcluster_request_phase_seconds. Prefill queue/compute are the prefilling worker's to
    observe: the router cannot tell them apart."""

    def __init__(self, arrival: float, metrics: Any = None, trace: tracing.Span = tracing.NO_SPAN) -> None:
        self.arrival, self.trace = arrival, trace
        self.metrics = tracing.observed(metrics, trace)  # phases also become spans of `trace` when tracing is on
        self.dispatched: float | None = None  # first worker call of the first attempt: router queue ends
        self.first_token: float | None = None
        self.transferred: float | None = None
        self.decoding: float | None = None  # the decode worker's first chunk after the KV arrived

    def mark(self, attr: str, phase: str | None = None, since: float | None = None) -> None:
        if getattr(self, attr) is not None:
            return  # a retry or resume: the first time counts
        now = time.monotonic()
        setattr(self, attr, now)
        if phase and since is not None and self.metrics is not None:
            self.metrics.phase(phase, now - since)

    def finished(self, reason: str | None, prompt_tokens: int, generated: int) -> None:
        if self.metrics is None:
            return
        now = time.monotonic()
        start = self.first_token or self.dispatched
        if start is not None:
            self.metrics.phase("decode", now - start)
        self.metrics.request_finished(reason, prompt_tokens, generated, now - self.arrival)


@dataclass
class Stages:
    """Requests currently in each stage; exported as pdcluster_router_requests_in_stage{stage}."""

    counts: dict[str, int] = field(default_factory=lambda: {"queued": 0, "prefill": 0, "transfer": 0, "decode": 0})

    @contextlib.contextmanager
    def enter(self, stage: str):  # type: ignore[no-untyped-def]
        self.counts[stage] += 1
        try:
            yield
        finally:
            self.counts[stage] -= 1

    def cursor(self, stage: str) -> StageCursor:
        return StageCursor(self, stage)


class StageCursor:
    """Where one request is now; `move` keeps the per-stage counts exact as it advances."""

    def __init__(self, stages: Stages, stage: str | None) -> None:
        self.stages = stages
        self.stage: str | None = None
        self.move(stage)

    def move(self, stage: str | None) -> None:
        if self.stage is not None:
            self.stages.counts[self.stage] -= 1
        self.stage = stage
        if stage is not None:
            self.stages.counts[stage] += 1
