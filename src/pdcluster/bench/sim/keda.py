"""`keda-tokens`: llm-d's token-aware KEDA autoscaling for a P/D-disaggregated pool pair, as its guide ships it
(llm-d `guides/workload-autoscaling/keda-epp-token-aware`, pd-disaggregation): a peer to compare against, not
ours. Two ScaledObjects, each pool blind to the other:

- prefill: the prompt tokens in flight at the prefill pods (the EPP's `llm_d_epp_inflight_tokens`: sent and
  not yet prefilled) divided by the calibrated per-replica prefill throughput V_P — seconds of backlog — with
  an `AverageValue` target of `TTFT_SLO - ISL/V_P` seconds per replica (the guide's rule for its threshold;
  ISL: the trace's mean prompt, which a user calibrates once);
- decode: the decode pods' KV-cache usage summed (pods' worth of full cache) at 0.8 per replica. The
  simulator has batch slots, not KV blocks (`cluster.py`): a decode instance's share of its batch stands
  for its cache usage;
- each as the HPA KEDA creates: polled every 15 s, `desired = ceil(metric / target)` outside a 10 % tolerance,
  scale-up at most one pod per 180 s with no stabilization, scale-down at most one pod per 300 s to the
  highest recommendation of the last 300 s. No role flips, no aggregation of its own (the router's
  `--load-aggregation` is the cluster's, as for every policy).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pdcluster.bench.sim.hpa import Behavior, HpaPool
from pdcluster.bench.sim.observe import PolicyInput
from pdcluster.operator.planner import Bounds

POLL_S = 15.0  # pollingInterval
# behavior: one pod per 180 s up, one per 300 s down after a 300 s window (the guide's, for weights that load in
# minutes)
BEHAVIOR = Behavior(tolerance=0.1, stabilization_s=300.0, up_pods=1, up_period_s=180.0, down_pods=1,
                    down_period_s=300.0)
DECODE_TARGET = 0.8  # pods' worth of full KV cache per replica
MIN_PREFILL_TARGET_S = 0.5  # a floor for TTFT - ISL/V_P where prompts alone nearly fill the TTFT budget


@dataclass
class KedaTokens:
    """llm-d's token-aware KEDA ScaledObjects, one per role (see the module docstring)."""

    bounds: Bounds
    prefill_tps: float  # V_P, the calibrated prefill throughput per replica
    prefill_target_s: float  # seconds of prefill backlog per replica
    name: str = "keda-tokens"
    start: tuple[int, int] | None = None
    pools: dict[str, HpaPool] = field(default_factory=lambda: {"prefill": HpaPool(), "decode": HpaPool()})
    interval_s: float = POLL_S  # the simulated loop ticks at the polling interval
    behavior: Behavior = BEHAVIOR

    @staticmethod
    def target_s(ttft_s: float, mean_input_tokens: float, prefill_tps: float) -> float:
        """The guide's threshold: the TTFT budget less one prompt's own prefill."""
        return max(MIN_PREFILL_TARGET_S, ttft_s - mean_input_tokens / prefill_tps)

    def initial(self) -> tuple[int, int]:
        return self.start or (self.bounds.min_prefill, self.bounds.min_decode)

    def decide(self, inp: PolicyInput) -> tuple[int, int]:
        b = self.bounds
        backlog_s = (inp.prefill_inflight_tokens or 0.0) / self.prefill_tps
        # KEDA never asks for fewer than one replica (its minReplicaCount is 1 at least)
        p = self.pools["prefill"].step(self.behavior, inp.now, inp.prefill_current, backlog_s, self.prefill_target_s,
                                       max(1, b.min_prefill), b.max_prefill)
        d = self.pools["decode"].step(self.behavior, inp.now, inp.decode_current, inp.decode_occupancy or 0.0,
                                      DECODE_TARGET, max(1, b.min_decode), b.max_decode)
        return p, d

    def carried(self, duration_s: float, sizes: tuple[int, int]) -> KedaTokens:
        """After a first pass over the trace (`policies.carry_over`): its history moved back, its sizes."""
        return replace(self, start=sizes, pools={r: p.shifted(duration_s) for r, p in self.pools.items()})
