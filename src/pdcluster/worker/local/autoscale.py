"""`pdcluster up --autoscale`: resize the local pools with the operator's own autoscaler core.

The decision is `pdcluster.operator.autoscaler.decide`, called with the same inputs the operator gives it;
only the source of the observation differs. In Kubernetes, Prometheus answers PromQL over a window
(`operator/promsource.py`); here the router's and the workers' `/metrics` are scraped directly and the same
quantities are computed from counter deltas between the first and the last scrape of the window:

- λ = requests/s at the router; I, O = the router's prompt/output tokens per request; O by completion = the
  mean length of the requests that finished (the router's `pdcluster_request_generation_tokens` sum / count);
  the load-aggregated rate = the router's `pdcluster_router_placements_total{placement="aggregated",
  reason="prefill_backlog"}` per second; the prompt-length SCV = `autoscaler_tail.histogram_scv` of the increases
  of the router's `pdcluster_request_prompt_tokens` buckets (over the decision window: `up` keeps no longer
  history, where the operator reads `SCV_WINDOW_SECONDS`);
- per-instance throughput = prompt tok/s of the prefill workers (output tok/s of the decode workers) divided
  by how many of them answered;
- saturated = the pool's summed `pdcluster_requests_waiting` stayed above 0 in every scrape of the window;
- t_join = the decode workers' mean `pdcluster_decode_join_seconds` less their mean step
  (`pdcluster_time_per_output_token_seconds`), from sum and count increases (`autoscaler_rules.join_cost`).

The autoscaler state (learned capacities, stabilization windows) lives in this process, as the operator
keeps it in the PDCluster's status. Disabled workers are the "replicas" that can be added; the ones started
last are stopped first.

Role flips (`flips=True`, where both pools run the same tensor-parallel size): a decision that grows one pool
while the other has slack (`autoscaler_flip.applied`) first moves running workers of the other pool by
`POST /internal/role` (the router follows the role they report), then starts workers for the rest. A flipped
worker that is stopped is its own pool's again: its process restarts with its `--role`.

With flips, the short-window step of the operator (`autoscaler_flip_window`, `--flip-window`: the CRD's
`spec.autoscaling.flipWindowSeconds`; 0 = off) runs every quarter window between decisions and on a decision's
tick that changes nothing: its observation is the same one over the last `--flip-window` seconds of scrapes
(`window_observation`), and it only flips running workers (a failed flip starts or stops nothing). A
decision's own flips keep what that window asks (`autoscaler_flip.applied`'s `keep`), as in the operator.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import httpx

from pdcluster.operator import autoscaler_explain, autoscaler_flip, autoscaler_flip_window
from pdcluster.operator.autoscaler import Decision, Observation, Policy, PoolView, State, decide
from pdcluster.operator.autoscaler_rules import join_cost
from pdcluster.operator.autoscaler_tail import histogram_scv
from pdcluster.worker.router import aggregate as agg
from pdcluster.worker.transfer.secret import internal_headers

POOLS = ("prefill", "decode")
# Which counter measures a pool's work (as in promsource): prompt tokens for prefill, output tokens for decode.
POOL_COUNTER = {"prefill": "pdcluster_prompt_tokens_total", "decode": "pdcluster_generation_tokens_total"}
# The router's placements the load rule made (promsource's load-aggregated rate), kept apart by `counters`.
PLACEMENTS = "pdcluster_router_placements_total"
LOAD_AGGREGATED = {"placement": agg.AGGREGATED, "reason": agg.PREFILL_BACKLOG}
LOAD_AGGREGATED_KEY = PLACEMENTS + ":load"
# The router's prompt-length buckets (the prefill tail need's SCV), one key per `le` besides the sum over them.
PROMPT_BUCKETS = "pdcluster_request_prompt_tokens_bucket"


def counters(text: str) -> dict[str, float]:
    """Prometheus text -> {series name: value summed over its label sets}, and besides the router's load-rule
    placements under LOAD_AGGREGATED_KEY and its prompt-length buckets under `PROMPT_BUCKETS:<le>`."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        key = name.split("{", 1)[0]
        keys = [key]
        if key == PLACEMENTS and all(f'{k}="{v}"' in name for k, v in LOAD_AGGREGATED.items()):
            keys.append(LOAD_AGGREGATED_KEY)
        if key == PROMPT_BUCKETS and 'le="' in name:
            le = name.split('le="', 1)[1].split('"', 1)[0]
            keys.append(f"{PROMPT_BUCKETS}:{le}")
        try:
            for k in keys:
                out[k] = out.get(k, 0.0) + float(value)
        except ValueError:
            continue
    return out


@dataclass(frozen=True)
class Scrape:
    t: float
    router: dict[str, float] | None  # None: the router did not answer
    workers: dict[str, tuple[str, dict[str, float]]] = field(default_factory=dict)  # name -> (role, series)

    def waiting(self, role: str) -> float | None:
        """Summed queue of the pool's workers that answered; None when none did."""
        vals = [s.get("pdcluster_requests_waiting", 0.0) for r, s in self.workers.values() if r == role]
        return sum(vals) if vals else None


def _increase(before: dict[str, float] | None, after: dict[str, float], key: str) -> float:
    """Counter increase; a counter that went down was reset (a restarted process) and counts from 0."""
    b, a = (before or {}).get(key, 0.0), after.get(key, 0.0)
    return a - b if a >= b else a


def observation(first: Scrape, last: Scrape, waiting: dict[str, list[float]]) -> Observation | None:
    """The operator's Observation from two scrapes and the queue samples between them (pure).
    None when the router was not reachable at either end (the operator's "metrics unavailable")."""
    dt = last.t - first.t
    if first.router is None or last.router is None or dt <= 0:
        return None
    rate = _increase(first.router, last.router, "pdcluster_requests_total") / dt
    prompt = _increase(first.router, last.router, "pdcluster_prompt_tokens_total") / dt
    gen = _increase(first.router, last.router, "pdcluster_generation_tokens_total") / dt
    finished = _increase(first.router, last.router, "pdcluster_request_generation_tokens_count")
    finished_tokens = _increase(first.router, last.router, "pdcluster_request_generation_tokens_sum")
    aggregated = (_increase(first.router, last.router, LOAD_AGGREGATED_KEY) / dt
                  if LOAD_AGGREGATED_KEY in last.router else None)  # the load rule has not placed one yet

    def per_instance(role: str) -> float | None:
        now = {n: s for n, (r, s) in last.workers.items() if r == role}
        if not now:
            return None
        before = {n: s for n, (_, s) in first.workers.items()}
        return sum(_increase(before.get(n), s, POOL_COUNTER[role]) for n, s in now.items()) / dt / len(now)

    def join() -> float | None:  # decode admission seconds per transferred request, less one step
        before = {n: s for n, (_, s) in first.workers.items()}
        now = [(before.get(n), s) for n, (r, s) in last.workers.items() if r == "decode"]

        def mean(series: str) -> float | None:
            n = sum(_increase(b, a, series + "_count") for b, a in now)
            return sum(_increase(b, a, series + "_sum") for b, a in now) / n if n > 0 else None

        return join_cost(mean("pdcluster_decode_join_seconds"), mean("pdcluster_time_per_output_token_seconds"))

    buckets = [(float(k.split(":", 1)[1]), _increase(first.router, last.router, k))
               for k in last.router if k.startswith(PROMPT_BUCKETS + ":")]
    return Observation(
        request_rate=rate,
        mean_input_tokens=prompt / rate if rate > 0 else None,
        mean_output_tokens=gen / rate if rate > 0 else None,
        prefill_tokens_per_instance=per_instance("prefill"),
        decode_tokens_per_instance=per_instance("decode"),
        prefill_saturated=bool(waiting.get("prefill")) and min(waiting["prefill"]) > 0,
        decode_saturated=bool(waiting.get("decode")) and min(waiting["decode"]) > 0,
        decode_join_seconds=join(),
        finished_output_tokens=finished_tokens / finished if finished > 0 else None,
        load_aggregated_rate=aggregated,
        prompt_length_scv=histogram_scv(buckets),
    )


def window_observation(scrapes: Sequence[Scrape], window_seconds: float) -> Observation | None:
    """The flip window's Observation (pure): `observation` from the newest scrape at least `window_seconds`
    before the last one to the last, with each pool's queue at the window's end (the last scrape's summed
    `pdcluster_requests_waiting`). None until the scrapes span the window (or without the router)."""
    if not scrapes:
        return None
    last = scrapes[-1]
    older = [s for s in scrapes if s.t <= last.t - window_seconds + 1e-9]
    if not older:
        return None
    first = older[-1]
    between = [s for s in scrapes if s.t >= first.t]
    waiting = {r: [w for s in between if (w := s.waiting(r)) is not None] for r in POOLS}
    obs = observation(first, last, waiting)
    if obs is None:
        return None
    return replace(obs, prefill_queue_now=last.waiting("prefill"), decode_queue_now=last.waiting("decode"))


def describe(d: Decision, before: dict[str, int]) -> str:
    """One line in the words of the operator's `Scaled` event (for the flip window's step, the inputs it read)."""
    i = d.inputs

    def f(v: float | None, unit: str = "") -> str:
        return "-" if v is None else f"{v:.3g}{unit}"

    if d.reason == autoscaler_flip.FLIP_WINDOW:
        return (f"prefill {before['prefill']}->{d.prefill.desired}, decode {before['decode']}->{d.decode.desired} "
                f"({d.reason}: {autoscaler_explain.window_inputs(d)}: flips only)")
    return (f"prefill {before['prefill']}->{d.prefill.desired}, decode {before['decode']}->{d.decode.desired} "
            f"({d.reason}: rate {f(i['requestRate'], ' req/s')}, I {f(i['meanInputTokens'])}, "
            f"O {f(i['meanOutputTokens'])}, C_p {f(i['prefillCapacity'])} ({i['prefillCapacitySource']}), "
            f"C_d {f(i['decodeCapacity'])} ({i['decodeCapacitySource']}), headroom {i['headroom']})")


class Procs(Protocol):  # what the autoscaler needs of the Supervisor
    procs: dict[str, Any]  # name -> Proc (.enabled, .popen)

    def enable(self, name: str) -> None: ...

    def disable(self, name: str) -> None: ...


class Autoscaler:
    """Scrapes every `interval / 10` s (the queue samples), decides every `interval` s with `decide`, and
    starts or stops workers to match; with flips and a `flip_window` (seconds, 0 = off: `up` passes
    `--flip-window`) the short-window flip step runs between decisions. `workers`: process name -> (role,
    base URL)."""

    def __init__(self, router: str, sup: Procs, workers: dict[str, tuple[str, str]], policy: Policy,
                 interval: float = 15.0, *, flip_window: float, secret: bytes | None = None,
                 flips: bool = True) -> None:
        self.router, self.sup, self.workers, self.policy, self.interval = router, sup, dict(workers), policy, interval
        self.origin = dict(workers)  # each worker's --role: what it is again once stopped
        self.secret, self.flips = secret, flips
        self.flip_window = float(flip_window) if flips else 0.0
        self.state = State()
        self.started = time.monotonic()
        self.next_scrape = self.started
        self.next_decision = self.started + interval
        self.first: Scrape | None = None
        self.waiting: dict[str, list[float]] = {r: [] for r in POOLS}
        self.last_reason: str | None = None
        # the flip window: the scrapes it spans, when its step runs next, and the last decision's recommendation
        self.recent: list[Scrape] = []
        self.next_flip = self.started + autoscaler_flip_window.period(self.flip_window) if self.flip_window else 0.0
        self.last_rec: dict[str, int | None] = {}

    def _running(self, role: str) -> list[str]:
        return sorted(n for n, (r, _) in self.workers.items()
                      if r == role and self.sup.procs[n].enabled and self.sup.procs[n].popen is not None)

    def _scrape(self, now: float) -> Scrape:
        def get(url: str) -> dict[str, float] | None:
            try:
                r = httpx.get(f"{url}/metrics", timeout=1.0)
            except httpx.HTTPError:
                return None
            return counters(r.text) if r.status_code == 200 else None

        workers = {}
        for role in POOLS:
            for name in self._running(role):
                series = get(self.workers[name][1])
                if series is not None:
                    workers[name] = (role, series)
        return Scrape(now, get(self.router), workers)

    def tick(self) -> list[str]:
        now = time.monotonic()
        if now < self.next_scrape:
            return []
        self.next_scrape = now + max(0.5, self.interval / 10)
        scrape = self._scrape(now)
        self._remember(scrape)
        samples = {r: [w] if (w := scrape.waiting(r)) is not None else [] for r in POOLS}
        if self.first is None:
            self.first, self.waiting = scrape, samples
            return []
        for r in POOLS:
            self.waiting[r] += samples[r]
        short = window_observation(self.recent, self.flip_window) if self.flip_window else None
        if now < self.next_decision:
            return self._flip_step(scrape, short, now) if self.flip_window and now >= self.next_flip else []
        self.next_decision = now + self.interval
        obs = observation(self.first, scrape, self.waiting)
        # This scrape ends one window and starts the next (its queue sample counts in both).
        self.first, self.waiting = scrape, samples
        current, views = self._views(scrape)
        short_need = autoscaler_flip_window.need(self.policy, self.state, short, self.flip_window) if self.flips else None
        d = decide(self.policy, self.state, obs, views["prefill"], views["decode"], now, short_need)
        self.state = d.state
        self.last_rec = {r: d.pool(r).recommended for r in POOLS}
        if self.flips:  # the short pool's growth from the other's slack, never below what the flip window keeps
            keep = autoscaler_flip_window.keep(self.policy, d.state, short, self.flip_window)
            d = autoscaler_flip.applied(d, self.policy, keep)
        events = self.apply(d, current)
        if self.flip_window and not d.changed:  # a decision that changes nothing: the flip step on its tick
            events += self._flip_step(scrape, short, now)
        return events

    def _remember(self, scrape: Scrape) -> None:
        """Keep the scrapes the flip window spans (from the newest one a window old)."""
        if not self.flip_window:
            return
        self.recent.append(scrape)
        old = [i for i, s in enumerate(self.recent) if s.t <= scrape.t - self.flip_window + 1e-9]
        if old:
            del self.recent[:old[-1]]

    def _views(self, scrape: Scrape) -> tuple[dict[str, int], dict[str, PoolView]]:
        # current = the workers we run (the operator's "replicas it last set"); ready = those that answered.
        current = {r: len(self._running(r)) for r in POOLS}
        ready = {r: sum(1 for role, _ in scrape.workers.values() if role == r) for r in POOLS}
        return current, {r: PoolView(current[r], ready[r], since=self.started) for r in POOLS}

    def _flip_step(self, scrape: Scrape, short: Observation | None, now: float) -> list[str]:
        """The operator's short-window flip step (`autoscaler_flip_window.window_flips`, pure): flips only."""
        self.next_flip = now + autoscaler_flip_window.period(self.flip_window)
        if not self.last_rec:  # no decision yet: no recommendation, no slack
            return []
        current, views = self._views(scrape)
        d = autoscaler_flip_window.window_flips(self.policy, self.state, short, views["prefill"], views["decode"],
                                                now, window_seconds=self.flip_window, recommended=self.last_rec)
        if d is None:
            return []
        self.state = d.state
        return self.apply(d, current, pods=False)

    def apply(self, d: Decision, current: dict[str, int], pods: bool = True) -> list[str]:
        """Carry out `d`: flips first, then (`pods`) start or stop workers for the rest; the events. The flip
        window's step passes `pods=False`: a flip that fails starts no worker and stops none."""
        events: list[str] = []
        if d.changed or d.reason != self.last_reason:
            events.append(f"autoscale: {describe(d, current)}")
        self.last_reason = d.reason
        events += self._flip({r: d.pool(r).desired for r in POOLS},
                             "starting a worker instead" if pods else "the pools stay as they are")
        if not pods:
            return events
        for role in POOLS:
            target, running = d.pool(role).desired, self._running(role)
            names = sorted(n for n, (r, _) in self.workers.items() if r == role)
            if target > len(running):
                for name in [n for n in names if n not in running][: target - len(running)]:
                    self.sup.enable(name)
                    events.append(f"autoscale: started {name}")
            elif target < len(running):
                for name in list(reversed(running))[: len(running) - target]:
                    self.sup.disable(name)
                    self.workers[name] = self.origin[name]  # restarted later with its own --role
                    events.append(f"autoscale: stopped {name}")
        return events

    def _flip(self, target: dict[str, int], on_failure: str) -> list[str]:
        """Move running workers from a pool above its target to one below it; the events."""
        events: list[str] = []
        for to in POOLS:
            source = "decode" if to == "prefill" else "prefill"
            running = self._running(source)
            n = min(target[to] - len(self._running(to)), len(running) - target[source])
            for name in list(reversed(running))[: max(0, n)]:
                url = self.workers[name][1]
                try:
                    r = httpx.post(f"{url}/internal/role", json={"role": to}, headers=internal_headers(self.secret),
                                   timeout=130.0)
                    ok = r.status_code == 200 and r.json().get("role") == to
                    said = r.json() if ok else f"HTTP {r.status_code}: {r.text[:200]}"
                except httpx.HTTPError as e:
                    ok, said = False, f"{type(e).__name__}: {e}"
                if not ok:
                    events.append(f"autoscale: RoleFlipFailed {name}: {said}; {on_failure}")
                    continue
                self.workers[name] = (to, url)
                seconds = said.get("seconds", 0.0) if isinstance(said, dict) else 0.0
                events.append(f"autoscale: RoleFlip: flipped {name}: {source} -> {to} in {seconds:.2f} s (no restart)")
        return events
