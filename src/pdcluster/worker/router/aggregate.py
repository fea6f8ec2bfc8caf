"""Load-driven aggregation: where a prompt long enough to disaggregate is prefilled when the prefill pool is
backlogged (issue 37 item 4). Pure functions over numbers the router already holds; no I/O.

The prompt-length rule (`--disaggregation-threshold`) sends every long prompt to a prefill worker. When that
worker's queue alone takes longer than the TTFT target (`--ttft-slo`, the CRD's `autoscaling.slo.ttftSeconds`)
the prompt would miss it anyway, while a decode worker with free batch slots and KV room could prefill it
itself now. So the router compares two estimates of this request's time to first token:

* remote: (prompt tokens queued at the prefill worker it would pick + this prompt's uncached tokens) / that
  worker's measured prefill throughput (the engine's own tokens/s over its recent prefill steps, reported on
  `/internal/load`; `outstanding_prompt_tokens` is the router's exact count of what it sent there);
* local: this prompt's uncached tokens / the decode worker's own measured prefill throughput (the prefill
  pool's when the decode worker has not prefilled anything yet: the same model on the same kind of machine).

It aggregates when the remote estimate is over the target and a decode worker has slack: a free batch slot,
nothing waiting, and free KV blocks for the whole request (never one without the room), and the local
estimate beats the remote one. Hysteresis keeps it from flapping: aggregation engages above the target and
disengages only once the remote estimate is back under `EXIT_RATIO` of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdcluster.worker.router.picking import blocks_needed

if TYPE_CHECKING:
    from pdcluster.worker.router.pool import Worker

# Aggregation disengages once the remote estimate falls under this share of the target (it engages above
# the target): between the two, the previous decision holds, so a queue hovering at the target does not
# alternate every request between the pools.
EXIT_RATIO = 0.8

# A decode worker prefills a prompt itself only when that takes at most this share of the TTFT target: its
# running streams wait behind the prompt (a gap of that length in their output), and a prompt no worker can
# prefill within the target (one too long for any single instance) must not stall a decode batch for nothing.
# 0.2 from `pdcluster simulate --load-aggregation` (docs/benchmarks/autoscaler.md): without a bound, Mooncake's
# 50k-token prompts stalled whole decode batches (96.2 % -> 91.4 % within SLO); 0.1-0.3 all help elsewhere.
LOCAL_BUDGET = 0.2

# Placement reasons (the `reason` label of pdcluster_router_placements_total).
SHORT_PROMPT = "short_prompt"  # under the disaggregation threshold: always on the decode worker
NO_PREFILL = "no_prefill"  # no healthy prefill worker (or none could take it)
NO_TRANSFER_PATH = "no_transfer_path"  # no decode worker can receive KV (secret not configured)
RESUME = "resume"  # a stream resumed on another decode worker re-prefills there
PROMPT_LENGTH = "prompt_length"  # long enough to disaggregate, and the prefill pool keeps up
PREFILL_BACKLOG = "prefill_backlog"  # the prefill queue misses the TTFT target: a decode worker prefills it
NO_DECODE_SLACK = "no_decode_slack"  # the queue misses the target, but no decode worker has the slack
SINGLE_TOKEN = "single_token"  # max_tokens 1: runs whole on the prefill worker
PREFILL_ENDED = "prefill_ended"  # --engine vllm: the prefill leg handed over no KV (its request ended at the first token)
AGGREGATED, DISAGGREGATED, AT_PREFILL = "aggregated", "disaggregated", "prefill_only"


def alone_reason(prompt_tokens: int, threshold: int) -> str:
    """Why a prompt that no prefill worker took runs on a decode worker alone: too short to be worth moving, or
    long enough but no prefill worker in rotation (either flow, before it tries a prefill leg)."""
    return SHORT_PROMPT if prompt_tokens < threshold else NO_PREFILL


@dataclass(frozen=True)
class PrefillBacklog:
    """The prefill worker the router would pick, as the router sees it."""

    queued_tokens: int  # prompt tokens sent there whose first token has not come back
    tokens_per_s: float | None  # its measured prefill throughput (None: not measured yet)
    cached_tokens: int = 0  # of this prompt, believed held in its prefix cache


@dataclass(frozen=True)
class DecodeSlack:
    """One decode candidate, in the order the router ranks them."""

    url: str
    free_blocks: int | None  # worker-reported (None: unknown, so never chosen to prefill)
    blocks_needed: int  # the request at its longest (prompt + max_tokens)
    running: int  # sequences decoding there (the larger of its report and the router's count)
    waiting: int  # requests queued in its engine
    max_batch: int | None  # its decode batch bound (None: unknown)
    tokens_per_s: float | None  # its own measured prefill throughput (None: not measured)
    cached_tokens: int = 0


@dataclass(frozen=True)
class Placement:
    aggregate: bool
    reason: str
    engaged: bool  # the hysteresis state after this decision
    remote_s: float | None = None  # estimated TTFT on the prefill pool
    local_s: float | None = None  # estimated TTFT on the chosen decode worker
    decode: str | None = None  # the decode worker chosen to prefill (aggregate only)


def backlog_of(w: Worker, cached_tokens: int = 0) -> PrefillBacklog:
    return PrefillBacklog(w.outstanding_prompt_tokens, w.prefill_tokens_per_s, cached_tokens)


def slack_of(w: Worker, prompt_tokens: int, max_tokens: int, cached_tokens: int = 0) -> DecodeSlack:
    """A decode worker as a candidate: its last report, and the router's own exact count of what it sent there
    since (in_flight), whichever shows more running."""
    need = blocks_needed(prompt_tokens, max_tokens, w.block_size or 0) if w.block_size else 1 << 30
    return DecodeSlack(w.url, w.free_blocks, need, max(w.running, w.in_flight), w.waiting, w.max_batch_size,
                       w.prefill_tokens_per_s, cached_tokens)


def remote_estimate(prompt_tokens: int, backlog: PrefillBacklog) -> float | None:
    """Seconds until this prompt's first token on the prefill worker: its queue, then the prompt itself."""
    if not backlog.tokens_per_s or backlog.tokens_per_s <= 0:
        return None
    work = max(0, backlog.queued_tokens) + max(0, prompt_tokens - backlog.cached_tokens)
    return work / backlog.tokens_per_s


def has_slack(d: DecodeSlack) -> bool:
    """A free batch slot, an empty queue, and (known) free KV blocks for the whole request."""
    if d.free_blocks is None or d.free_blocks < d.blocks_needed:
        return False
    if d.waiting > 0:
        return False
    return d.max_batch is None or d.running < d.max_batch


def decide(prompt_tokens: int, backlog: PrefillBacklog, candidates: Sequence[DecodeSlack], slo_s: float,
           engaged: bool) -> Placement:
    """Prefill-remote or prefill-on-decode for a prompt the length rule would disaggregate.

    `engaged`: the previous decision's state (hysteresis). `slo_s` <= 0 turns the load rule off."""
    if slo_s <= 0:
        return Placement(False, PROMPT_LENGTH, False)
    remote = remote_estimate(prompt_tokens, backlog)
    if remote is None:  # nothing measured yet: no evidence of a backlog
        return Placement(False, PROMPT_LENGTH, engaged)
    engaged = remote >= EXIT_RATIO * slo_s if engaged else remote > slo_s
    if not engaged:
        return Placement(False, PROMPT_LENGTH, False, remote_s=remote)
    for d in candidates:
        if not has_slack(d):
            continue
        rate = d.tokens_per_s or backlog.tokens_per_s
        if not rate:
            continue
        local = max(0, prompt_tokens - d.cached_tokens) / rate
        if local < remote and local <= LOCAL_BUDGET * slo_s:
            return Placement(True, PREFILL_BACKLOG, True, remote_s=remote, local_s=local, decode=d.url)
    return Placement(False, NO_DECODE_SLACK, True, remote_s=remote)


class Placements:
    """What the router decided, counted by (placement, reason): pdcluster_router_placements_total, and the
    load rule's last estimate and state (`/cluster`)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        self.engaged = False
        self.last: Placement | None = None

    def count(self, placement: str, reason: str) -> None:
        key = (placement, reason)
        self.counts[key] = self.counts.get(key, 0) + 1

    def describe(self) -> dict[str, object]:
        last = self.last
        return {"load_aggregation_engaged": self.engaged,
                "prefill_wait_estimate_s": None if last is None else last.remote_s,
                "placements": [{"placement": p, "reason": r, "count": n} for (p, r), n in sorted(self.counts.items())]}
