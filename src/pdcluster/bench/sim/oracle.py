"""`reactive-oracle`: the operator's core fed the true arrival rate the moment it changes.

A computed bound on what better observation could give `pdcluster`: the same `decide` (same headroom,
stabilization, step limits, SLO guard, burst memory, role flips) and the same pod start, but instead of a
Prometheus window of 120 s scraped every 30 s it sees, every `interval_s` (10 s), the requests that arrived
in the last `window_s` (10 s, the burst window): their rate, mean prompt and output lengths (the output
lengths are known at arrival: more than any real scaler sees; `known_outputs=False` reads O as the cluster
measured it instead) and that rate as the peak. Everything else (latencies, queues, throughput, prefix
hits) is what the cluster measured. It never looks ahead: a burst
is seen as it starts, and the pods it asks for are ready `pod_start_s` later, as for every policy.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace
from itertools import accumulate

from pdcluster.bench.sim.observe import PolicyInput
from pdcluster.bench.sim.policies import Core, _shift_pool
from pdcluster.bench.trace import Trace
from pdcluster.operator.autoscaler import State

ORACLE_WINDOW_S = 10.0
ORACLE_INTERVAL_S = 10.0


@dataclass
class Arrivals:
    """Prefix sums over the trace's arrivals: the count and token sums of any time range in O(log n)."""

    times: list[float]
    prompt: list[int]  # prompt[i] = sum of input tokens of requests [0, i)
    output: list[int]

    @classmethod
    def of(cls, trace: Trace) -> Arrivals:
        reqs = trace.requests
        return cls([r.t for r in reqs], [0, *accumulate(r.input_tokens for r in reqs)],
                   [0, *accumulate(max(1, r.output_tokens) for r in reqs)])

    def between(self, t0: float, t1: float) -> tuple[int, int, int]:
        """(requests, prompt tokens, output tokens) of the arrivals in (t0, t1]."""
        i, j = bisect.bisect_right(self.times, t0), bisect.bisect_right(self.times, t1)
        return j - i, self.prompt[j] - self.prompt[i], self.output[j] - self.output[i]


@dataclass
class ReactiveOracle(Core):
    arrivals: Arrivals = field(default_factory=lambda: Arrivals([], [0], [0]))
    window_s: float = ORACLE_WINDOW_S
    interval_s: float = ORACLE_INTERVAL_S
    known_outputs: bool = True  # O from the arrivals' output lengths (else as the cluster measured it)

    def decide(self, inp: PolicyInput) -> tuple[int, int]:
        n, prompt, output = self.arrivals.between(inp.now - self.window_s, inp.now)
        obs = inp.observation
        if obs is not None:
            rate = n / self.window_s
            obs = replace(obs, request_rate=rate, peak_request_rate=rate,
                          mean_input_tokens=prompt / n if n else obs.mean_input_tokens,
                          mean_output_tokens=output / n if n and self.known_outputs else obs.mean_output_tokens)
        return super().decide(replace(inp, observation=obs))

    def carried(self, duration_s: float, sizes: tuple[int, int]) -> ReactiveOracle:
        """See `policies.carry_over`: the state of a first pass, times moved back by its duration."""
        state = State(prefill=_shift_pool(self.state.prefill, duration_s),
                      decode=_shift_pool(self.state.decode, duration_s))
        return ReactiveOracle(self.core, self.name, start=sizes, burst_s=self.burst_s, state=state, flip=self.flip,
                              fast_s=self.fast_s, last_obs=self.last_obs, last_rec=dict(self.last_rec),
                              arrivals=self.arrivals, window_s=self.window_s, interval_s=self.interval_s,
                              known_outputs=self.known_outputs)
