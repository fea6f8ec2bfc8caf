"""Requests no policy can serve within the SLO, by construction of the trace and the service model.

A request is infeasible when even an idle cluster of any size misses its SLO:

- `prefill_exceeds_ttft`: the prompt's prefill alone on one instance, plus its KV transfer, takes longer
  than the TTFT target. Prefill of one prompt runs on one instance (`ServiceModel`), so more instances do
  not shorten it. A prefix-cache hit could still save some of them (`prefix_could_rescue` counts those
  whose blocks not held by any earlier request would fit: the best an unbounded cache could do); they
  stay counted, since whether the hit happens is up to the router and the cache, not the scaler.
- `decode_step_exceeds_tpot`: a lone sequence's decode step is already longer than the TPOT target.

Attainment over the feasible requests says how close a policy gets to what is reachable at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcluster.bench.sim.model import SLO, ServiceModel
from pdcluster.bench.trace import Trace

PREFILL_EXCEEDS_TTFT = "prefill_exceeds_ttft"
DECODE_STEP_EXCEEDS_TPOT = "decode_step_exceeds_tpot"


@dataclass(frozen=True)
class Feasibility:
    feasible: tuple[bool, ...]  # per request, in trace order
    why: dict[str, int]  # reason -> requests (a request with both reasons counts under both)
    prefix_could_rescue: int = 0

    @property
    def infeasible(self) -> int:
        return sum(not f for f in self.feasible)

    def summary(self, slo: SLO, model: ServiceModel) -> dict:
        n = len(self.feasible)
        return {
            "count": self.infeasible,
            "share": self.infeasible / n if n else 0.0,
            "why": dict(self.why),
            "prefix_could_rescue": self.prefix_could_rescue,
            "rule": (f"prefill of the prompt on one instance at {model.prefill_tps:g} tok/s plus its KV transfer "
                     f"> TTFT {slo.ttft_s:g} s; or a lone decode step {model.step_s(1):.4f} s > TPOT "
                     f"{slo.tpot_s:g} s"),
        }


def best_cached_tokens(blocks: tuple[int, ...] | None, seen: set[int], block_tokens: int, tokens: int) -> int:
    """Tokens of the prompt's leading blocks that some earlier request held (the last token is computed)."""
    if not blocks:
        return 0
    n = 0
    while n < len(blocks) and blocks[n] in seen:
        n += 1
    return max(0, min(n * block_tokens, tokens - 1))


def feasibility(trace: Trace, model: ServiceModel, slo: SLO) -> Feasibility:
    seen: set[int] = set()
    caching = model.prefix_cache_tokens > 0
    decode_too_slow = model.step_s(1) > slo.tpot_s
    why = {PREFILL_EXCEEDS_TTFT: 0, DECODE_STEP_EXCEEDS_TPOT: 0}
    out: list[bool] = []
    rescue = 0

    def too_slow(tokens: int, computed: int) -> bool:
        return computed / model.prefill_tps + model.transfer_s(tokens) > slo.ttft_s

    for r in trace.requests:
        cached = best_cached_tokens(r.hash_ids, seen, trace.block_tokens, r.input_tokens) if caching else 0
        if r.hash_ids:
            seen.update(r.hash_ids)
        slow_prefill = too_slow(r.input_tokens, r.input_tokens)
        rescue += slow_prefill and not too_slow(r.input_tokens, r.input_tokens - cached)
        slow_decode = decode_too_slow and r.output_tokens > 1
        why[PREFILL_EXCEEDS_TTFT] += slow_prefill
        why[DECODE_STEP_EXCEEDS_TPOT] += slow_decode
        out.append(not (slow_prefill or slow_decode))
    return Feasibility(tuple(out), why, rescue)
