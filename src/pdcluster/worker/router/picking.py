"""The router's decisions, as pure functions over a snapshot of the pools (no I/O, trivially testable)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerView:
    """What the router knows about one worker at decision time."""

    url: str
    role: str  # prefill | decode | both
    healthy: bool = True
    node: str | None = None  # Kubernetes NODE_NAME, when the worker reports it
    # router-side bookkeeping (exact, updated on every dispatch and completion)
    outstanding_prompt_tokens: int = 0
    in_flight: int = 0
    # worker-reported load (from its /internal/load, refreshed by the health loop)
    free_blocks: int | None = None
    total_blocks: int | None = None
    running: int = 0
    waiting: int = 0


# Affinity may choose a worker at most this many requests busier than the least-loaded one: a shared prefix
# is worth a short wait, but a popular one must not pile every request on the worker that holds it.
AFFINITY_SLACK = 4


def pick_prefill(workers: Sequence[WorkerView], exclude: Collection[str] = (), *, prompt_tokens: int = 0,
                 cached: Mapping[str, int] | None = None, slack: int = AFFINITY_SLACK) -> WorkerView | None:
    """Least outstanding prompt tokens: prefill time is roughly linear in prompt tokens, so this is the
    worker that will get to a new prompt soonest. Ties go to fewer in-flight requests, then URL order
    (deterministic).

    With `cached` (url -> prompt tokens that worker is believed to hold in its prefix cache) the cost is the
    work queued there plus this prompt's uncached tokens, so a long cached prefix wins over a slightly
    shorter queue and loses to a much shorter one; and only workers within `slack` in-flight requests of
    the least-loaded one compete on it (the load cap that overrides affinity)."""
    ok = [w for w in workers if w.healthy and w.url not in exclude]
    if not ok:
        return None
    least = min(ok, key=lambda w: (w.outstanding_prompt_tokens, w.in_flight, w.url))
    if not cached:
        return least
    band = [w for w in ok if w.in_flight <= least.in_flight + slack]
    return min(band, key=lambda w: (w.outstanding_prompt_tokens + max(0, prompt_tokens - cached.get(w.url, 0)),
                                    w.in_flight, w.url))


def decode_score(w: WorkerView, prefer_node: str | None) -> tuple[int, int, int, int, str]:
    """Smaller is better. Same node first (KV moves over loopback/NVLink instead of the network), then the
    fewest requests decoding there (batch slots: what TPOT depends on), then the most free KV blocks (room
    to grow without preemption). `in_flight` is the router's own exact count, so a burst of requests
    spreads at once instead of piling onto whichever worker the last probe showed as emptiest."""
    same_node = 0 if prefer_node and w.node == prefer_node else 1
    free = w.free_blocks if w.free_blocks is not None else 0
    return (same_node, decode_load(w), -free, w.in_flight, w.url)


def pick_decode(
    workers: Sequence[WorkerView],
    *,
    prefer_node: str | None = None,
    exclude: Collection[str] = (),
    need_blocks: int = 0,
) -> WorkerView | None:
    """Best decode worker that (as far as we know) has room for `need_blocks`. A worker whose free-block
    count is unknown is allowed: its /internal/reserve is the real admission check."""
    ok = [
        w for w in workers
        if w.healthy and w.url not in exclude and (w.free_blocks is None or w.free_blocks >= need_blocks)
    ]
    if not ok:
        return None
    return min(ok, key=lambda w: decode_score(w, prefer_node))


def decode_load(w: WorkerView) -> int:
    """Requests on a decode worker (running or queued), by the larger of its report and our own count."""
    return max(w.running, w.in_flight) + w.waiting


def rank_decode(workers: Sequence[WorkerView], *, prefer_node: str | None = None,
                exclude: Collection[str] = (), cached: Mapping[str, int] | None = None,
                slack: int = AFFINITY_SLACK) -> list[WorkerView]:
    """All usable decode workers, best first (the router walks this list when reservations are refused).

    `exclude` (workers that already failed this request) is a preference, not a ban: when every healthy
    decode worker is excluded — one decode worker, restarted after it died — they are ranked anyway, so a
    request resumes on whatever is healthy instead of waiting for a worker that does not exist.

    `cached` (url -> prompt tokens believed cached there; for requests the decode worker prefills itself)
    moves the workers holding the longest prefix to the front, but only those within `slack` requests of the
    least-loaded worker: past that, load wins and affinity is ignored."""
    healthy = [w for w in workers if w.healthy]
    ok = [w for w in healthy if w.url not in exclude] or healthy
    ranked = sorted(ok, key=lambda w: decode_score(w, prefer_node))
    if not cached or not ranked:
        return ranked
    floor = min(decode_load(w) for w in ranked)
    band = [w for w in ranked if decode_load(w) <= floor + slack and cached.get(w.url, 0) > 0]
    front = sorted(band, key=lambda w: -cached.get(w.url, 0))  # stable: decode_score breaks ties
    return front + [w for w in ranked if w not in front]


def should_disaggregate(prompt_tokens: int, threshold: int, have_prefill: bool) -> bool:
    """Short prompts prefill on the decode worker: moving their KV costs more than it saves."""
    return have_prefill and prompt_tokens >= threshold


def blocks_needed(prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """Blocks a request will hold at its longest (ceil division)."""
    if block_size <= 0:
        return 0
    return -(-(prompt_tokens + max_tokens) // block_size)


def admit(queued: int, max_queue_depth: int | None) -> bool:
    """Bounded queue: admit while fewer than `max_queue_depth` requests wait (None or <= 0: unbounded)."""
    return not max_queue_depth or max_queue_depth <= 0 or queued < max_queue_depth


def retry_after_seconds(queued: int, completions_per_s: float) -> int:
    """Retry-After hint: the time the current queue takes to drain at the recent completion rate, clamped
    to 1..30 s so clients neither hammer nor give up."""
    if completions_per_s <= 0:
        return 1
    return max(1, min(30, round(queued / completions_per_s)))


# Probes failed in a row before a worker leaves rotation: one lost probe is not an outage.
DROP_AFTER = 2
# The same for probes that only timed out while the worker was busy (pool.busy): a server saturated by its own
# work (vLLM's /health and /metrics behind a CPU busy with prefill, a starved node) answers late without being
# down, and dropping it moves its load onto the others, or turns a P/D pair's prefill into aggregated work on
# decode. A dead worker still drops after DROP_AFTER (refused, reset, HTTP errors), and the request path marks
# it failed at once.
BUSY_DROP_AFTER = 5


def health_transition(healthy: bool, consecutive_failures: int, ok: bool,
                      drop_after: int = DROP_AFTER) -> tuple[bool, int]:
    """Next (healthy, consecutive_failures) after one probe: drop after `drop_after` failures in a row
    (one lost probe is not an outage), re-admit on the first success."""
    if ok:
        return True, 0
    failures = consecutive_failures + 1
    return (healthy and failures < drop_after), failures
