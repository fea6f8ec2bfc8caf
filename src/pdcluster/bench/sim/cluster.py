"""The discrete-event P/D cluster: router queue -> prefill pool -> KV transfer -> decode pool.

- Router: admits a request while fewer than `max_queue_depth` requests wait for their first token (the
  router's own bound), else rejects it (a 429: counted, never lost, and an SLO miss).
- Prefill: one FCFS queue in front of the pool (the router sends to the least-loaded worker, which a
  shared queue approximates); an instance serves one prompt at a time at `prefill_tps`. With `hash_ids`
  (Mooncake) each instance keeps an LRU prefix cache of `prefix_cache_tokens`: the leading blocks it
  already holds are hits (counted as pdcluster_prefix_cache_hit_tokens_total) and only the rest is
  computed. The router is not prefix-aware, so a hit needs the same instance (or a shared system prefix).
- KV transfer: `transfer_s(prompt tokens)` after prefill, then the request waits for a decode slot.
- Decode: continuous batching up to `decode_batch`; the first token streams when the request joins a
  batch (so a decode shortage shows in TTFT, as it does behind the real router), the rest at the
  batch-size-dependent step time. Decode progress is a fluid model (a per-instance virtual clock), so
  the cost is O(log n) per request event rather than per token.
- Scaling: when the policy is asked and what it sees (its ticks, the fast path, the short-window flip
  step) is `autoscaling.py`; here, what its answer does to the pools. New pods are ready `pod_start_s`
  later; removed pods that had not started yet are cancelled, started ones drain (no new work, finish what
  they hold) and then stop.
- Role flips (a policy's `pending_flips` after a decision, `operator/autoscaler_flip.py`): the worker
  stops admitting work for its old role, finishes what it holds, then serves the other role `flip_s`
  later (weights kept: no pod start); billed throughout as one instance.
- Load-driven aggregation (`--load-aggregation`, `aggregation.py`): at arrival the router's own decision
  may have a decode instance with a free slot prefill the prompt itself while its batch waits.
- Cost: every instance is billed from creation to stop, over [0, last arrival].
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

from pdcluster.bench.sim import aggregation, autoscaling
from pdcluster.bench.sim.model import ServiceModel
from pdcluster.bench.sim.observe import Counters, Sampler
from pdcluster.bench.trace import Trace

ARRIVAL, PREFILL_DONE, TRANSFER_DONE, DECODE_DONE, POD_READY = range(5)
TICK = autoscaling.TICK  # 5
SAMPLE = 6
LOCAL_DONE = aggregation.LOCAL_DONE  # 7
FAST = autoscaling.FAST  # 8: the fast scale-up path between two ticks
FLIPW = autoscaling.FLIPW  # 9: the short-window flip step between two ticks
SCRAPE = autoscaling.SCRAPE  # 10: a Prometheus scrape of the counters (with ServiceModel.scrape_s)


class Instance:
    __slots__ = ("role", "created", "ready", "draining", "ended", "busy", "n", "v", "last", "fin", "ver", "cache",
                 "flip_to")

    def __init__(self, role: str, created: float) -> None:
        self.role, self.created = role, created
        self.ready = self.draining = False
        self.ended: float | None = None
        self.busy: int | None = None  # prefill: the request being prefilled
        self.n, self.v, self.last, self.ver = 0, 0.0, created, 0  # decode: batch, virtual tokens, clock
        self.fin: list[tuple[float, int]] = []  # decode: (virtual finish, request)
        self.cache: OrderedDict[int, None] = OrderedDict()  # prefill: prefix blocks held, LRU order
        self.flip_to: str | None = None  # draining to serve this role next (a role flip)

    @property
    def serving(self) -> bool:
        return self.ready and not self.draining and self.ended is None


@dataclass
class Pool:
    role: str
    instances: list[Instance] = field(default_factory=list)
    desired: int = 0
    incoming: int = 0  # workers of the other pool draining to flip into this one

    def alive(self) -> list[Instance]:
        return [i for i in self.instances if i.ended is None]

    def ready_count(self) -> int:
        return sum(i.serving for i in self.instances)

    def reporting(self) -> int:
        """Instances exposing metrics (started, not yet stopped, draining included)."""
        return sum(i.ready and i.ended is None for i in self.instances)


@dataclass
class RunResult:
    arrival: list[float]
    first_token: list[float | None]
    done: list[float | None]
    rejected: list[bool]
    output_tokens: list[int]
    input_tokens: list[int]
    horizon_s: float
    prefill_instance_hours: float
    decode_instance_hours: float
    scale_events: int
    max_prefill: int
    max_decode: int
    timeline: list[tuple[float, int, int, int, int, float]]  # t, P desired, D desired, P ready, D ready, λ
    generated_tokens: float
    prefilled_tokens: int
    prefix_hit_tokens: int = 0
    flips: int = 0
    aggregated: int = 0  # requests prefilled on a decode instance (load-driven aggregation)
    steps_by_cause: dict[str, int] = field(default_factory=dict)  # "role:cause" -> size changes (Core policies)
    decision_log: list[dict] = field(default_factory=list)  # per-tick rows, when the policy keeps a log


class Cluster:
    def __init__(self, trace: Trace, model: ServiceModel, policy, *, interval_s: float = 30.0,
                 window_s: float = 120.0) -> None:
        self.reqs = trace.requests
        self.m, self.policy = model, policy
        # a policy may decide more often than the operator's 30 s (the reactive oracle)
        self.interval_s, self.window_s = getattr(policy, "interval_s", interval_s), window_s
        self.fast_s = float(getattr(policy, "fast_s", 0.0) or 0.0)  # the fast path's period (0: none)
        # the short-window flip step (`operator/autoscaler_flip_window.py`): its window, and its period when
        # shorter than the decisions' (else it runs on their tick)
        self.flipw_s = float(getattr(policy, "flip_window_s", 0.0) or 0.0)
        self.flipw_tick_s = float(getattr(policy, "flip_tick_s", 0.0) or 0.0)
        self.horizon = trace.duration_s
        n = len(self.reqs)
        self.first: list[float | None] = [None] * n
        self.done: list[float | None] = [None] * n
        self.rejected = [False] * n
        self.out = [max(1, r.output_tokens) for r in self.reqs]
        self.events: list[tuple[float, int, int, object, int]] = []
        self.seq = 0
        self.pools = {"prefill": Pool("prefill"), "decode": Pool("decode")}
        self.pqueue: list[int] = []  # FIFO as list + head index: cheaper than deque slicing here
        self.phead = 0
        self.dqueue: list[int] = []
        self.dhead = 0
        self.pending_first = 0
        self.c = Counters()
        core = getattr(policy, "core", None)
        self.sampler = Sampler(window_s, burst_s=getattr(policy, "burst_s", 0.0),
                               percentile=getattr(core, "slo_percentile", None))
        self.block_tokens = trace.block_tokens
        self.cache_blocks = model.prefix_cache_tokens // max(1, trace.block_tokens)
        self.scale_events = 0
        self.flips = 0
        self.timeline: list[tuple[float, int, int, int, int, float]] = []
        self.pqueued_tokens = 0  # prompt tokens admitted to the prefill pool and not yet prefilled
        self.agg_engaged = False

    # ---- plumbing --------------------------------------------------------------------------------
    def push(self, t: float, kind: int, a: object = None, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    def set_size(self, role: str, desired: int, now: float) -> None:
        pool = self.pools[role]
        pool.desired = desired
        active = [i for i in pool.alive() if not i.draining]
        for _ in range(desired - len(active) - pool.incoming):
            inst = Instance(role, now)
            pool.instances.append(inst)
            self.push(now + self.m.pod_start_s, POD_READY, inst)
        surplus = len(active) - desired
        if surplus <= 0:
            return
        # Cancel pods that never started first (newest first), then drain the least-loaded ones.
        victims = sorted(active, key=lambda i: (i.ready, (i.busy is not None) + i.n, -i.created))[:surplus]
        for inst in victims:
            inst.draining = True
            if not inst.ready or (inst.busy is None and inst.n == 0):
                inst.ended = now

    def flip(self, src: str, dst: str, n: int, now: float) -> None:
        """Move `n` serving workers (the least loaded) from pool `src` to `dst` (see the module docstring)."""
        cands = sorted((i for i in self.pools[src].instances if i.serving),
                       key=lambda i: ((i.busy is not None) + i.n, -i.created))[:n]
        for inst in cands:
            inst.draining, inst.flip_to = True, dst
            self.pools[dst].incoming += 1
            if inst.busy is None and inst.n == 0:
                self.retire(inst, now)

    def retire(self, inst: Instance, now: float) -> None:
        """A draining worker that holds nothing: it stops, or starts serving its new role flip_s later."""
        inst.ended = now
        if inst.flip_to is None:
            return
        pool = self.pools[inst.flip_to]
        pool.incoming -= 1
        new = Instance(inst.flip_to, now)
        pool.instances.append(new)
        self.flips += 1
        self.push(now + self.m.flip_s, POD_READY, new)

    # ---- prefill ----------------------------------------------------------------------------------
    def prefill_dispatch(self, now: float) -> None:
        if self.phead >= len(self.pqueue):
            return
        for inst in self.pools["prefill"].instances:
            if self.phead >= len(self.pqueue):
                break
            if inst.serving and inst.busy is None:
                rid = self.pqueue[self.phead]
                self.phead += 1
                inst.busy = rid
                r = self.reqs[rid]
                self.c.prefill_tokens += r.input_tokens
                hit = self.prefix_hits(inst, r.hash_ids, r.input_tokens)
                self.c.prefix_hit_tokens += hit
                self.push(now + (r.input_tokens - hit) / self.m.prefill_tps, PREFILL_DONE, inst, rid)

    def prefix_hits(self, inst: Instance, blocks: tuple[int, ...] | None, tokens: int) -> int:
        """Tokens of the prompt's leading blocks this instance holds; then it holds all of them (LRU)."""
        if not blocks or self.cache_blocks <= 0:
            return 0
        cache, n = inst.cache, 0
        while n < len(blocks) and blocks[n] in cache:
            n += 1
        for b in blocks:
            cache[b] = None
            cache.move_to_end(b)
        while len(cache) > self.cache_blocks:
            cache.popitem(last=False)
        # the last token is always computed (its logits start decoding), as in the engine
        return min(n * self.block_tokens, tokens - 1)

    # ---- decode -----------------------------------------------------------------------------------
    def advance(self, d: Instance, now: float) -> None:
        if now < d.last:  # paused: prefilling a prompt itself (load-driven aggregation) until d.last
            return
        if d.n and now > d.last:
            dv = (now - d.last) / self.m.step_s(d.n)
            d.v += dv
            self.c.generated += dv * d.n
        d.last = now

    def reschedule(self, d: Instance, now: float) -> None:
        d.ver += 1
        if d.fin:
            self.push(max(now, d.last) + max(0.0, d.fin[0][0] - d.v) * self.m.step_s(d.n), DECODE_DONE, d, d.ver)

    def decode_dispatch(self, now: float) -> None:
        while self.dhead < len(self.dqueue):
            free = [i for i in self.pools["decode"].instances if i.serving and i.n < self.m.decode_batch]
            if not free:
                return
            d = min(free, key=lambda i: i.n)
            rid = self.dqueue[self.dhead]
            self.dhead += 1
            self.first[rid] = now
            self.sampler.ttft.append((now, now - self.reqs[rid].t))
            self.pending_first -= 1
            self.c.generated += 1  # the first token
            if self.out[rid] == 1:
                self.finish(rid, now)
                continue
            self.advance(d, now)
            heapq.heappush(d.fin, (d.v + self.out[rid] - 1, rid))
            d.n += 1
            self.reschedule(d, now)

    def finish(self, rid: int, now: float) -> None:
        """Request `rid` generated its last token (pdcluster_request_generation_tokens observes its length,
        pdcluster_request_prompt_tokens its prompt's)."""
        self.done[rid] = now
        self.sampler.prompts.append((now, self.reqs[rid].input_tokens))
        self.c.finished += 1
        self.c.finished_tokens += self.out[rid]

    def decode_done(self, d: Instance, ver: int, now: float) -> None:
        if ver != d.ver or d.ended is not None:
            return
        self.advance(d, now)
        while d.fin and d.fin[0][0] <= d.v + 1e-9:
            _, rid = heapq.heappop(d.fin)
            self.finish(rid, now)
            self.sampler.tpot.append((now, (now - self.first[rid]) / (self.out[rid] - 1)))  # type: ignore[operator]
            d.n -= 1
        if d.n == 0:
            d.v = 0.0  # keep the virtual clock small (float precision over long runs)
        if d.draining and d.n == 0:
            self.retire(d, now)
        self.decode_dispatch(now)
        self.reschedule(d, now)

    # ---- main loop --------------------------------------------------------------------------------
    def run(self) -> RunResult:
        p0, d0 = self.policy.initial()
        for role, n in (("prefill", p0), ("decode", d0)):
            self.pools[role].desired = n
            for _ in range(n):
                inst = Instance(role, 0.0)
                inst.ready = True
                self.pools[role].instances.append(inst)
        self.timeline.append((0.0, p0, d0, p0, d0, 0.0))
        for rid, r in enumerate(self.reqs):
            self.push(r.t, ARRIVAL, None, rid)
        self.sampler.record_counters(0.0, self.c)
        self.push(0.0, SAMPLE)
        autoscaling.start(self)
        self.loop()
        return self.result()

    def loop(self) -> None:
        ev = self.events
        while ev:
            now, _, kind, a, b = heapq.heappop(ev)
            if kind == ARRIVAL:
                if self.pending_first >= self.m.max_queue_depth:
                    self.rejected[b] = True
                    continue
                self.pending_first += 1
                self.c.admitted += 1
                self.sampler.admit_times.append(now)
                self.c.prompt_tokens += self.reqs[b].input_tokens
                if aggregation.place(self, b, now):
                    continue
                self.pqueue.append(b)
                self.pqueued_tokens += self.reqs[b].input_tokens
                self.prefill_dispatch(now)
            elif kind == PREFILL_DONE:
                inst = a
                inst.busy = None  # type: ignore[attr-defined]
                self.pqueued_tokens -= self.reqs[b].input_tokens
                self.push(now + self.m.transfer_s(self.reqs[b].input_tokens), TRANSFER_DONE, None, b)
                if inst.draining:  # type: ignore[attr-defined]
                    self.retire(inst, now)  # type: ignore[arg-type]
                self.prefill_dispatch(now)
            elif kind == TRANSFER_DONE:
                self.dqueue.append(b)
                self.decode_dispatch(now)
            elif kind == DECODE_DONE:
                self.decode_done(a, b, now)  # type: ignore[arg-type]
            elif kind == POD_READY:
                inst = a
                if inst.ended is None:  # type: ignore[attr-defined]
                    inst.ready = True  # type: ignore[attr-defined]
                    inst.last = now  # type: ignore[attr-defined]
                    self.prefill_dispatch(now)
                    self.decode_dispatch(now)
            elif kind == LOCAL_DONE:
                aggregation.local_done(self, a, b, now)  # type: ignore[arg-type]
            elif kind == TICK:
                autoscaling.tick(self, now)
            elif kind == FAST:
                autoscaling.fast_tick(self, now)
            elif kind == FLIPW:
                autoscaling.flip_tick(self, now)
            elif kind == SCRAPE:
                autoscaling.scrape(self, now)
            elif kind == SAMPLE:
                self.sampler.record_queues(now, len(self.pqueue) - self.phead, len(self.dqueue) - self.dhead)
                if now + self.sampler.step_s <= self.horizon:
                    self.push(now + self.sampler.step_s, SAMPLE)

    def result(self) -> RunResult:
        h = self.horizon

        def hours(role: str) -> float:
            return sum(max(0.0, min(i.ended if i.ended is not None else h, h) - min(i.created, h))
                       for i in self.pools[role].instances) / 3600.0

        return RunResult(
            arrival=[r.t for r in self.reqs], first_token=self.first, done=self.done, rejected=self.rejected,
            output_tokens=self.out, input_tokens=[r.input_tokens for r in self.reqs], horizon_s=h,
            prefill_instance_hours=hours("prefill"), decode_instance_hours=hours("decode"),
            scale_events=self.scale_events,
            max_prefill=max(t[1] for t in self.timeline), max_decode=max(t[2] for t in self.timeline),
            timeline=self.timeline, generated_tokens=self.c.generated, prefilled_tokens=self.c.prefill_tokens,
            prefix_hit_tokens=self.c.prefix_hit_tokens, flips=self.flips, aggregated=self.c.load_aggregated,
            steps_by_cause=dict(getattr(self.policy, "steps", {})),
            decision_log=list(getattr(self.policy, "log", None) or []),
        )


def simulate(trace: Trace, model: ServiceModel, policy, **kw) -> RunResult:
    return Cluster(trace, model, policy, **kw).run()
