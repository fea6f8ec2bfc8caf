"""Keep a served decode step on the cores: the HTTP event loop runs in the step's gaps, never preempting it.

Every step ends with a cross-thread wake-up of the event loop (``call_soon_threadsafe`` writes its self-pipe).
Linux then lets the freshly woken loop thread preempt whatever runs on the CPU it lands on: on a box with no
idle core (2 cores, 2 torch threads, or any other load) that is the engine thread itself, stopped inside the
pipe write, or an OpenMP worker the next matmul's barrier waits for. A py-spy profile of ``pdcluster serve``
(batch 1, docs/benchmarks/engine.md at 5f904a5) had the engine thread in that one write for a third of its samples.

``SCHED_BATCH`` tells the scheduler a thread never preempts on wake-up; it still gets its fair share of CPU
(it is not ``SCHED_IDLE``), so it runs as soon as a core frees up: between parallel regions, when the step
ends, or at the next tick. Any unprivileged thread may lower itself to it. Threads inherit the policy of
the thread that creates them, so the engine thread must exist before the loop demotes itself.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def yield_on_wakeup() -> bool:
    """Put the calling thread in ``SCHED_BATCH`` (Linux); False where the platform or policy refuses."""
    setter = getattr(os, "sched_setscheduler", None)
    policy = getattr(os, "SCHED_BATCH", None)
    if setter is None or policy is None:
        return False
    try:
        setter(0, policy, os.sched_param(0))  # pid 0: the calling thread
    except OSError as e:  # e.g. a seccomp profile that forbids it: serving works, just without this
        log.info("event loop stays SCHED_OTHER (%s): engine steps may be preempted by HTTP work", e)
        return False
    return True
