"""Service models and SLOs: what one simulated instance can do, and what a request must meet."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServiceModel:
    """Per-instance capacities (defaults: the seed example's) and the cluster's fixed costs.

    Prefill is compute-bound: one prompt at a time at `prefill_tps` (batching prompts does not raise
    throughput past that). Decode is memory-bound: a step costs `full_step*(0.5 + 0.5*n/batch)` for n
    sequences, so at the full batch the instance produces exactly `decode_tps` output tokens/s and a
    lone sequence decodes about twice as fast per token.
    """

    prefill_tps: float = 10_000.0
    decode_tps: float = 2_000.0
    decode_batch: int = 32
    pod_start_s: float = 60.0
    flip_s: float = 5.0  # a worker switching role once drained (weights kept): reconfigure, warm up
    kv_transfer_tps: float = 200_000.0  # prompt tokens whose KV moves per second between instances
    kv_transfer_base_s: float = 0.005  # per-transfer setup (connection, metadata)
    max_queue_depth: int = 256  # the router's default bound on requests waiting for a first token
    # Prefix cache per prefill instance (tokens of KV kept for reuse; 0 = no prefix caching). 500k tokens is
    # ~60 GB of bf16 KV for an 8B GQA model (128 KiB/token): what one 80-141 GB GPU keeps beside weights.
    prefix_cache_tokens: int = 500_000
    # The router's --ttft-slo (load-driven aggregation, worker/router/aggregate.py); 0: off, as the router's
    aggregate_ttft_s: float = 0.0
    # Prometheus's scrape interval of the router's counters: the autoscaler reads them as of the last scrape,
    # half an interval before its steps (scrapes at s/2 + k·s). 0: read exactly at each step (the default).
    scrape_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("prefill_tps", "decode_tps", "kv_transfer_tps"):
            v = getattr(self, name)
            if not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name.replace('_', '-')} must be > 0 (got {v})")
        if self.decode_batch < 1:
            raise ValueError(f"decode batch must be >= 1 (got {self.decode_batch})")
        if self.pod_start_s < 0:
            raise ValueError(f"pod start delay must be >= 0 (got {self.pod_start_s})")
        if self.flip_s < 0:
            raise ValueError(f"flip time must be >= 0 (got {self.flip_s})")
        if not (math.isfinite(self.scrape_s) and self.scrape_s >= 0):
            raise ValueError(f"scrape interval must be >= 0 (got {self.scrape_s})")

    def step_s(self, n: int) -> float:
        full = self.decode_batch / self.decode_tps
        return full * (0.5 + 0.5 * min(n, self.decode_batch) / self.decode_batch)

    def transfer_s(self, tokens: int) -> float:
        return self.kv_transfer_base_s + tokens / self.kv_transfer_tps


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 5.0
    tpot_s: float = 0.1
    target: float = 0.99  # share of requests that must meet both

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0 and 0 < self.target <= 1):
            raise ValueError("SLO TTFT and TPOT must be > 0 and the target in (0, 1]")


def capacities_from_profile(path: Path) -> tuple[float | None, float | None, int | None]:
    """(prefill tok/s, decode tok/s, decode batch) from `pdcluster profile --json` output."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such profile file") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a `pdcluster profile --json` output ({e})") from None
    if not isinstance(data, dict) or not ("prefill_tokens_per_second" in data or "decode_tokens_per_second" in data):
        raise ValueError(f"{path}: not a `pdcluster profile --json` output (no *_tokens_per_second)")
    return (data.get("prefill_tokens_per_second"), data.get("decode_tokens_per_second"),
            data.get("recommended_max_batch_size"))
