"""The router's options, declared once (rows of `pdcluster.worker.options.Option`).

`pdcluster router`'s flags and the router flags of `pdcluster up` are generated from this table,
`spec.router`'s defaults are read from it (operator/models.py), and `RouterOptions` is what the command line
passes down to `RouterState` and `Flow`: a router started by hand, by `up` or by the operator gets the same
value for a knob nobody set.

Stdlib only: the operator imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdcluster.worker import options as declared
from pdcluster.worker.options import Option

ROUTINGS = ("prefix", "least-loaded")

ROUTER_OPTIONS: tuple[Option, ...] = (
    # 256: absorbs a burst at a multi-worker cluster's concurrency (a decode worker batches 16 by default)
    # before answering 429 with Retry-After, so clients back off instead of timing out. spec.router's
    # maxQueueDepth allows no unbounded queue; the CLI's 0 does
    Option("max_queue_depth", "--max-queue-depth", int, 256,
           "requests waiting for their first token beyond which the router answers 429 (0: unbounded)",
           minimum=0, metavar="N"),
    # 64, not 256: measured (docs/benchmarks/heatmaps.md), disaggregation lowers TPOT p99 at every prompt
    # length and costs TTFT only for prompts of 16-64 tokens, where the transfer outweighs a few-ms prefill.
    # From 64 tokens on the decode pool is protected from the prefill work it would otherwise interleave.
    Option("disaggregation_threshold", "--disaggregation-threshold", int, 64,
           "prompts shorter than this prefill on the decode worker itself (0: always disaggregate)", minimum=0,
           metavar="TOKENS"),
    # 0 (off) unless a target is declared: the operator passes spec.autoscaling.slo.ttftSeconds. With one, a
    # prompt the threshold would disaggregate prefills on a decode worker with slack while the prefill queue
    # alone would miss it (router/aggregate.py)
    Option("ttft_slo", "--ttft-slo", float, 0.0,
           "TTFT target in seconds: while the prefill pool's queue would miss it, decode workers with free "
           "batch slots and KV room prefill long prompts themselves (0: only --disaggregation-threshold "
           "decides)", minimum=0.0, metavar="S"),
    # 300 s: long generations (thousands of tokens at tens of ms each) finish; the operator gives pods this
    # plus 30 s to drain after SIGTERM
    Option("request_timeout", "--request-timeout", float, 300.0, "504 after S seconds (0: none)", minimum=0.0,
           metavar="S"),
    Option("max_retries", "--max-retries", int, 2,
           "re-runs of a request on another worker pair after failures", minimum=0, metavar="N"),
    Option("decode_wait", "--decode-wait", float, 30.0,
           "how long a request waits for any healthy decode worker (e.g. the only one restarting) before it "
           "ends with a 503 / error event; keep it well under --request-timeout", minimum=0.0, metavar="S"),
    Option("routing", "--routing", str, "prefix",
           "prefix: prefer the worker believed to hold the prompt's longest cached prefix, within a load cap; "
           "least-loaded: ignore prefix caches", choices=ROUTINGS),
    Option("health_interval", "--health-interval", float, 1.0,
           "seconds between probes of each worker (and DNS lookups of the --*-service names)", minimum=0.0,
           min_exclusive=True, metavar="S"),
)
BY_NAME = declared.by_name(ROUTER_OPTIONS)


def default(name: str) -> Any:
    return BY_NAME[name].default


@dataclass(frozen=True)
class RouterOptions:
    """The router's knobs, built from the flags (`from_args`) and passed down as a whole. The field defaults
    are the table's; every value is checked against it."""

    max_queue_depth: int = default("max_queue_depth")
    disaggregation_threshold: int = default("disaggregation_threshold")
    ttft_slo: float = default("ttft_slo")
    request_timeout: float = default("request_timeout")
    max_retries: int = default("max_retries")
    decode_wait: float = default("decode_wait")
    routing: str = default("routing")
    health_interval: float = default("health_interval")

    def __post_init__(self) -> None:
        declared.check_fields(self, ROUTER_OPTIONS)

    @classmethod
    def from_args(cls, args: Any) -> RouterOptions:
        """From a namespace parsed with `add_arguments`."""
        return cls(**declared.values_of(args, ROUTER_OPTIONS))


def add_arguments(group: Any, names: tuple[str, ...] | None = None, *, help_prefix: str = "") -> None:
    """The router's knob flags (all, or the rows named), generated from the table."""
    declared.add_arguments(group, rows(names), help_prefix=help_prefix)


def rows(names: tuple[str, ...] | None) -> tuple[Option, ...]:
    return ROUTER_OPTIONS if names is None else tuple(BY_NAME[n] for n in names)
