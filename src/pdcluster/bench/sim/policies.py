"""Scaling policies compared by the simulator.

- `pdcluster`: the operator's own core, `pdcluster.operator.autoscaler.decide`, with its State carried
  from tick to tick (stabilization windows, step limits, rollout waits, learned capacities), the
  spec's capacities (what `pdcluster profile` writes into spec.autoscaling.capacity), the SLO guard
  (spec.autoscaling.slo = the simulation's SLO), the peak λ over `burstWindowSeconds`, the prefix-hit
  discount and role flips (`spec.roleFlips`, on by default wherever the pools are compatible): a short
  pool takes its growth from the other pool's slack by flips first (`operator/autoscaler_flip.py`;
  `ServiceModel.flip_s`), and every 5 s a flip-only step on the last 20 s moves workers toward the split
  that window asks for (`operator/autoscaler_flip_window.py`, spec.autoscaling.flipWindowSeconds): the
  defaults a PDCluster gets.
- `pdcluster-no-flips`: the same with `spec.roleFlips: false` (or pools a flip cannot join: another
  engine, model or layout): every size change is a pod start or a pod stop.
- `pdcluster-no-prefix`: the same as `pdcluster` without the prefix-hit discount of I (not in the default
  set: to show what the discount is worth on a trace with prefix reuse).
- `pdcluster-no-tail`: the same as `pdcluster` without the prefill tail need (`operator/autoscaler_tail.py`; not
  in the default set: what sizing prefill for the prompt-length tail is worth).
- `reactive-oracle`: the same core (flips included; no flip window: it reads the mix every 10 s already) fed
  the true arrival rate every 10 s (`oracle.py`): a bound, not a policy one could run (it needs the trace).
- `no-headroom`: the same core (flips and the flip window included) at headroom 1.0.
- `independent`: each pool sized alone from its own utilisation, as an HPA would do it:
  `desired = ceil(ready · utilisation / target)` with target 1/1.5 (the same headroom), a 10% tolerance,
  a 300 s scale-down stabilization (the highest recommendation in the window) and the same step limits.
- `keda-tokens`: llm-d's token-aware KEDA autoscaling for P/D as its guide ships it (`keda.py`): prefill on
  seconds of prompt tokens in flight, decode on its KV usage, each an HPA of its own: the peer users deploy.
- `static-P:D`: fixed sizes, never scaled.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pdcluster.bench.sim import decisions
from pdcluster.bench.sim.hpa import Behavior, HpaPool
from pdcluster.bench.sim.keda import KedaTokens
from pdcluster.bench.sim.model import SLO
from pdcluster.bench.sim.observe import PolicyInput
from pdcluster.bench.trace import Trace, summarize
from pdcluster.operator import autoscaler_explain, autoscaler_fast, autoscaler_flip, autoscaler_flip_window
from pdcluster.operator.autoscaler import Decision, Observation, PoolView, State, decide
from pdcluster.operator.autoscaler import Policy as CorePolicy
from pdcluster.operator.autoscaler_fast import Gauges
from pdcluster.operator.models import Autoscaling
from pdcluster.operator.planner import Bounds, plan

NAMES = ("pdcluster", "pdcluster-no-flips", "reactive-oracle", "no-headroom", "independent", "keda-tokens",
         "static-1:1", "static-best")
EXTRA = ("pdcluster-no-prefix", "pdcluster-no-tail")
BURST_S = 10.0  # spec.autoscaling.burstWindowSeconds' default
# spec.autoscaling.flipWindowSeconds' default: `pdcluster` flips on that short window too (autoscaler_flip_window)
FLIP_WINDOW_S = float(Autoscaling.model_fields["flipWindowSeconds"].default)
WINDOW_S = 120.0  # spec.autoscaling.windowSeconds' default, the Sampler's window (Policy.from_spec sets it)


@dataclass
class Static:
    prefill: int
    decode: int

    @property
    def name(self) -> str:
        return f"static-{self.prefill}:{self.decode}"

    def initial(self) -> tuple[int, int]:
        return self.prefill, self.decode

    def decide(self, inp: PolicyInput) -> tuple[int, int]:
        return self.prefill, self.decode


@dataclass
class Core:
    """The operator's decide() in the loop; `core` is exactly what Policy.from_spec would build."""

    core: CorePolicy
    name: str = "pdcluster"
    start: tuple[int, int] | None = None  # sizes at t=0 (None: the minimums)
    burst_s: float = BURST_S  # the metrics source's peak-λ window (0: mean λ only)
    state: State = field(default_factory=State)
    decisions: list[str] = field(default_factory=list)
    flip: bool = False  # take a short pool's growth from the other's slack by role flips (autoscaler_flip)
    pending_flips: tuple[int, int] = (0, 0)  # (decode -> prefill, prefill -> decode) of the last decision
    steps: dict[str, int] = field(default_factory=dict)  # "role:cause" -> pool size changes (autoscaler_explain)
    log: list[dict] | None = None  # per-tick decision rows (`decisions.py`), when asked for
    fast_s: float = 0.0  # period of the fast scale-up path on queue gauges (`operator/autoscaler_fast.py`); 0: off
    last_obs: Observation | None = None  # the last windowed observation (the fast path's work per request)
    last_rec: dict[str, int | None] = field(default_factory=dict)  # the last decision's recommendation per pool
    # role flips on a short window (`operator/autoscaler_flip_window.py`, spec.autoscaling.flipWindowSeconds;
    # 0: off): its window, and its period where shorter than the decisions' (0: on their tick, as the operator)
    flip_window_s: float = 0.0
    flip_tick_s: float = 0.0

    def initial(self) -> tuple[int, int]:
        return self.start or (self.core.bounds.min_prefill, self.core.bounds.min_decode)

    def policy(self) -> CorePolicy:
        """The operator's policy as this core runs it (its burst window)."""
        return replace(self.core, burst_window_seconds=self.burst_s or None)

    def decide(self, inp: PolicyInput) -> tuple[int, int]:
        core = self.policy()
        views = (PoolView(inp.prefill_current, inp.prefill_ready, since=0.0),
                 PoolView(inp.decode_current, inp.decode_ready, since=0.0))
        short_need = (autoscaler_flip_window.need(core, self.state, inp.short_observation, self.flip_window_s)
                      if self.flip else None)
        d = decide(core, self.state, inp.observation, *views, inp.now, short_need)
        if inp.observation is not None:
            self.last_obs = inp.observation
        self.last_rec = {"prefill": d.prefill.recommended, "decode": d.decode.recommended}
        if self.log is not None:
            self.log.append(decisions.row(inp.now, inp.observation, *views, d))
        keep = (autoscaler_flip_window.keep(core, d.state, inp.short_observation, self.flip_window_s)
                if self.flip else None)
        sizes = self._apply(d, core, keep)
        if d.changed or self.pending_flips != (0, 0):
            return sizes
        return self.flip_window(inp.now, inp.short_observation, *views) or sizes

    def flip_window(self, now: float, short: Observation | None, prefill: PoolView,
                    decode: PoolView) -> tuple[int, int] | None:
        """The short-window flip step (`autoscaler_flip_window`): new sizes, or None to leave the pools."""
        self.pending_flips = (0, 0)
        if not (self.flip and self.flip_window_s):
            return None
        core = self.policy()
        d = autoscaler_flip_window.window_flips(core, self.state, short, prefill, decode, now,
                                                window_seconds=self.flip_window_s, recommended=self.last_rec)
        if d is None:
            return None
        if self.log is not None:
            self.log.append(decisions.row(now, short, prefill, decode, d))
        return self._apply(d, core)

    def _apply(self, d: Decision, core: CorePolicy, keep: dict[str, int] | None = None) -> tuple[int, int]:
        """Take the decision: its state, its reason, its flips (with `flip`), the steps by cause; the sizes."""
        self.state = d.state
        self.decisions.append(d.reason)
        causes = autoscaler_explain.causes(d)
        sizes = (d.prefill.desired, d.decode.desired)
        self.pending_flips = (0, 0)
        if self.flip:
            fp = autoscaler_flip.plan(d, core, keep)
            self.pending_flips = (fp.to_prefill, fp.to_decode)
            if fp.flips:
                self.decisions[-1] = d.reason if d.reason == autoscaler_flip.FLIP_WINDOW else autoscaler_flip.FLIP
                causes = {"prefill": "flip", "decode": "flip"}
            sizes = (fp.prefill, fp.decode)
        for role, n, cur in (("prefill", sizes[0], d.prefill.current), ("decode", sizes[1], d.decode.current)):
            if n != cur:
                key = f"{role}:{causes[role]}"
                self.steps[key] = self.steps.get(key, 0) + 1
        return sizes

    def fast(self, now: float, gauges: dict[str, Gauges], prefill: PoolView, decode: PoolView) -> tuple[int, int] | None:
        """The fast path between two decisions: new sizes, or None to leave the pools as they are."""
        core = self.policy()
        d = autoscaler_fast.fast_decide(core, self.state, self.last_obs, gauges, prefill, decode, now, self.last_rec)
        self.pending_flips = (0, 0)
        if d is None:
            return None
        if self.log is not None:
            row = decisions.row(now, None, prefill, decode, d)
            for role, g in gauges.items():
                row[f"{role}_queue_now"] = g.queue_now
            self.log.append(row)
        return self._apply(d, core)


def _shift_pool(ps, dt: float):
    def f(x: float | None) -> float | None:
        return None if x is None else x - dt

    return replace(ps, below_since=f(ps.below_since), last_change=f(ps.last_change), ready_at=f(ps.ready_at),
                   recent_needs=tuple((t - dt, n) for t, n in ps.recent_needs),
                   recent_bursts=tuple((t - dt, n) for t, n in ps.recent_bursts))


def carry_over(policy, duration_s: float, sizes: tuple[int, int]):
    """The policy as it stands after a previous pass over a trace of `duration_s`: its state with times
    moved back by the duration (the next pass starts at 0) and the sizes it ended with.

    A trace cut from a longer day does not start from an autoscaler that has never seen the traffic:
    priming with a pass over the same trace stands for "the previous hour looked like this one"."""
    if hasattr(policy, "carried"):
        return policy.carried(duration_s, sizes)
    if isinstance(policy, Core):
        state = State(prefill=_shift_pool(policy.state.prefill, duration_s),
                      decode=_shift_pool(policy.state.decode, duration_s))
        return Core(policy.core, policy.name, start=sizes, burst_s=policy.burst_s, state=state, flip=policy.flip,
                    fast_s=policy.fast_s, last_obs=policy.last_obs, last_rec=dict(policy.last_rec),
                    flip_window_s=policy.flip_window_s, flip_tick_s=policy.flip_tick_s)
    if isinstance(policy, Independent):
        return replace(policy, start=sizes, pools={r: p.shifted(duration_s) for r, p in policy.pools.items()})
    return policy


def default_names(trace: Trace) -> list[str]:
    """The policies `simulate` runs without `--policy`: NAMES, and `pdcluster-no-prefix` beside `pdcluster` for
    a trace with prefix reuse (`hash_ids`), to show what the prefix discount does."""
    names = list(NAMES)
    if any(r.hash_ids for r in trace.requests[:100]):
        names.insert(1, "pdcluster-no-prefix")
    return names


def for_trace(policy, trace: Trace):
    """The policy, primed on another trace, about to run over `trace`: the oracle reads `trace`'s arrivals
    (every other policy only carries what it saw)."""
    if hasattr(policy, "arrivals"):
        from pdcluster.bench.sim.oracle import Arrivals

        return replace(policy, arrivals=Arrivals.of(trace))
    return policy


@dataclass
class Independent:
    """HPA-style: each pool from its own utilisation, blind to the other pool and to queues."""

    bounds: Bounds
    target: float = 1 / 1.5
    behavior: Behavior = Behavior()  # a 10 % tolerance, 300 s scale-down window, 4 up and 1 down a decision
    name: str = "independent"
    start: tuple[int, int] | None = None
    pools: dict[str, HpaPool] = field(default_factory=lambda: {"prefill": HpaPool(), "decode": HpaPool()})

    def initial(self) -> tuple[int, int]:
        return self.start or (self.bounds.min_prefill, self.bounds.min_decode)

    def _pool(self, role: str, now: float, current: int, ready: int, util: float | None) -> int:
        lo = self.bounds.min_prefill if role == "prefill" else self.bounds.min_decode
        hi = self.bounds.max_prefill if role == "prefill" else self.bounds.max_decode
        if util is None or ready < current:  # no metrics, or pods still starting: hold, like HPA
            return current
        return self.pools[role].step(self.behavior, now, current, util * ready, self.target, lo, hi)

    def decide(self, inp: PolicyInput) -> tuple[int, int]:
        return (self._pool("prefill", inp.now, inp.prefill_current, inp.prefill_ready, inp.prefill_utilisation),
                self._pool("decode", inp.now, inp.decode_current, inp.decode_ready, inp.decode_utilisation))


def core_policy(prefill_tps: float, decode_tps: float, headroom: float = 1.5,
                bounds: Bounds | None = None, slo: SLO | None = None, use_prefix_hits: bool = True) -> CorePolicy:
    """The autoscaler policy a PDCluster with default autoscaling, profiled capacities and `slo` gets."""
    return CorePolicy(headroom=headroom, bounds=bounds or Bounds(), prefill_capacity=prefill_tps,
                      decode_capacity=decode_tps, slo_ttft_seconds=slo.ttft_s if slo else None,
                      slo_tpot_seconds=slo.tpot_s if slo else None, slo_percentile=slo.target if slo else 0.99,
                      use_prefix_hits=use_prefix_hits, window_seconds=WINDOW_S)


def warm_start(trace: Trace, prefill_tps: float, decode_tps: float, headroom: float,
               window_s: float = 120.0) -> tuple[int, int]:
    """The formula's sizes for the trace's first window: a cluster that was already running before the
    trace began (a trace cut from a longer day does not start from an idle, minimum-sized cluster)."""
    first = [r for r in trace.requests if r.t < window_s] or list(trace.requests[:1])
    n = len(first)
    p = plan(input_len=max(1e-9, sum(r.input_tokens for r in first) / n),
             output_len=max(1e-9, sum(r.output_tokens for r in first) / n),
             prefill_capacity=prefill_tps, decode_capacity=decode_tps, request_rate=n / window_s,
             headroom=headroom)
    return p.prefill_replicas or 1, p.decode_replicas or 1


def make(name: str, prefill_tps: float, decode_tps: float, bounds: Bounds | None = None,
         trace: Trace | None = None, slo: SLO | None = None, headroom: float = 1.5, fast_s: float = 0.0,
         flip_window_s: float | None = None, flip_tick_s: float | None = None):
    """A policy by name (`_make`); the policies built on the operator's core run the fast path on queue
    gauges every `fast_s` seconds between their decisions (`operator/autoscaler_fast.py`; 0: never); those
    that flip, but the oracle (which reads the mix every 10 s already), flip on a `flip_window_s` window
    too (`operator/autoscaler_flip_window.py`; None: the CRD's flipWindowSeconds, 0: never), every
    `flip_tick_s` (None: the operator's period, a quarter of the window; 0: on their decisions' tick only)."""
    policy = _make(name, prefill_tps, decode_tps, bounds, trace, slo, headroom)
    if isinstance(policy, Core):
        policy.fast_s = fast_s
        if policy.flip and not hasattr(policy, "arrivals"):
            w = FLIP_WINDOW_S if flip_window_s is None else flip_window_s
            policy.flip_window_s = w
            policy.flip_tick_s = (autoscaler_flip_window.period(w) if w else 0.0) if flip_tick_s is None else flip_tick_s
    return policy


def _make(name: str, prefill_tps: float, decode_tps: float, bounds: Bounds | None = None,
         trace: Trace | None = None, slo: SLO | None = None, headroom: float = 1.5):
    """A policy by name; with `trace`, autoscaled policies start warm (see `warm_start`); with `slo`, the
    operator's core guards it (spec.autoscaling.slo); `headroom` is the pdcluster policies'."""
    bounds = bounds or Bounds()

    def start(h: float) -> tuple[int, int] | None:
        return warm_start(trace, prefill_tps, decode_tps, h) if trace is not None else None

    if name in ("pdcluster", "pdcluster-no-flips"):
        return Core(core_policy(prefill_tps, decode_tps, headroom, bounds, slo), name, start(headroom),
                    flip=name == "pdcluster")
    if name == "pdcluster-no-prefix":
        return Core(core_policy(prefill_tps, decode_tps, headroom, bounds, slo, use_prefix_hits=False),
                    "pdcluster-no-prefix", start(headroom), flip=True)
    if name == "pdcluster-no-tail":
        return Core(replace(core_policy(prefill_tps, decode_tps, headroom, bounds, slo), tail_need=False),
                    name, start(headroom), flip=True)
    if name == "reactive-oracle":
        from pdcluster.bench.sim.oracle import Arrivals, ReactiveOracle  # oracle builds on Core

        if trace is None:  # a name check (cli validates names before reading the trace)
            return ReactiveOracle(core_policy(prefill_tps, decode_tps, headroom, bounds, slo), name, flip=True)
        return ReactiveOracle(core_policy(prefill_tps, decode_tps, headroom, bounds, slo), name, start(headroom),
                              flip=True, arrivals=Arrivals.of(trace))
    if name == "no-headroom":
        return Core(core_policy(prefill_tps, decode_tps, 1.0, bounds, slo), "no-headroom", start(1.0), flip=True)
    if name == "independent":
        return Independent(bounds, start=start(1.5))
    if name == "keda-tokens":
        isl = summarize(trace)["mean_input_tokens"] if trace and trace.requests else 0.0
        ttft = slo.ttft_s if slo else SLO().ttft_s
        return KedaTokens(bounds, prefill_tps, KedaTokens.target_s(ttft, isl, prefill_tps), start=start(1.5))
    if name.startswith("static-") and ":" in name:
        p, _, d = name[len("static-"):].partition(":")
        if p.isdigit() and d.isdigit() and int(p) >= 1 and int(d) >= 1:
            return Static(int(p), int(d))
    raise ValueError(f"unknown policy {name!r} (choose from {', '.join(NAMES + EXTRA)}, or static-P:D)")
