"""The SLO guard of `decide`: which percentile each pool answers for, and whether its breach grows it now.

A pool grows past the formula (reason `SLOBreached`) when its percentile is broken *and* a queue in front
of it explains the breach, still there at the window's end, and the breach is news (see `fires`). The
decode pool answers for TPOT (unless the router's load-driven aggregation explains the breach:
`valve_explains`), and for TTFT when its own queue waits (`targets`); decode's queue is the
window's mean or, while it builds, the queue at the window's end (`rules.queue_in_front`), prefill's the
mean. Pure: the autoscaler core's types come from `autoscaler.py`, which imports this module.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from pdcluster.operator import autoscaler_rules as rules

if TYPE_CHECKING:
    from pdcluster.operator.autoscaler import Observation, Policy, PoolState, PoolView

Pair = tuple[float | None, float | None]  # (observed percentile, target)


def slo_targets(policy: Policy, obs: Observation | None) -> dict[str, Pair]:
    """(observed percentile, target) per pool: TTFT is prefill's SLO, TPOT decode's."""
    return {"prefill": (obs.ttft_seconds if obs else None, policy.slo_ttft_seconds),
            "decode": (obs.tpot_seconds if obs else None, policy.slo_tpot_seconds)}


def targets(policy: Policy, obs: Observation | None) -> dict[str, Pair]:
    """The pair each pool's guard acts on: `slo_targets`, except that decode also answers for TTFT when its
    own queue waits. A full decode batch delays the first token, not TPOT (the batch bound caps the step
    time): when the load turns to long outputs, requests queue for a decode slot with TPOT met, and the
    formula's O (generated tokens / requests) is capped by what the saturated pool produces, so nothing
    else would grow decode (a shift from 6k-token prompts to 900-token outputs: minutes of misses)."""
    out = slo_targets(policy, obs)
    if valve_explains(obs, *out["decode"]):
        out["decode"] = (None, out["decode"][1])
    observed, target = out["decode"]
    ttft, ttft_target = out["prefill"]
    if obs is not None and ttft is not None and ttft_target is not None and not rules.breached(observed, target) \
            and rules.breached(ttft, ttft_target):
        w = wait(obs, "decode")[0]
        q = rules.queue_in_front(obs.decode_queue_mean, obs.decode_queue_now)
        if w is not None and rules.guard_applies(q, obs.request_rate, ttft_target):
            out["decode"] = (min(ttft, ttft_target + w), ttft_target)
    return out


def valve_explains(obs: Observation | None, tpot: float | None, target: float | None) -> bool:
    """Whether decode's TPOT breach is the price of the router's load-driven aggregation rather than news of
    a short decode pool: in a window where the router had decode workers prefill prompts themselves because
    the prefill queue missed its TTFT target (worker/router/aggregate.py), their batches stood still
    meanwhile. The cure is prefill capacity, which the prefill pool's own formula and guard order; decode pods
    ordered for it start after the backlog that engaged the valve and only take more of its prompts (Azure
    cold with aggregation: 3 decode pods for 6 minutes, 0 requests more within SLO). The aggregation only
    takes a decode worker with a free slot and nothing queued for decode, so decode had slack when it did;
    a decode queue that waits while TPOT holds still answers for TTFT (`targets`)."""
    return bool(obs is not None and obs.load_aggregated_rate and rules.breached(tpot, target))


def queue_mean(obs: Observation | None, role: str) -> float | None:
    return (obs.prefill_queue_mean if role == "prefill" else obs.decode_queue_mean) if obs else None


def queue_now(obs: Observation | None, role: str) -> float | None:
    """The pool's queue at the window's end (None: the instant series is missing)."""
    return (obs.prefill_queue_now if role == "prefill" else obs.decode_queue_now) if obs else None


def wait(obs: Observation | None, role: str) -> tuple[float | None, float | None]:
    """(the wait the pool's queue adds over the window, the wait it adds now); None: unknown."""
    if obs is None:
        return None, None
    return (rules.queue_wait(queue_mean(obs, role), obs.request_rate),
            rules.queue_wait(queue_now(obs, role), obs.request_rate))


def work(policy: Policy, obs: Observation | None, ps: PoolState, role: str) -> float | None:
    """One request's instance-seconds in the pool at the capacity the formula uses (I'/C_p, O/C_d + t_join);
    None when a length or the capacity is unknown."""
    if obs is None:
        return None
    configured = policy.prefill_capacity if role == "prefill" else policy.decode_capacity
    base = configured or ps.learned_capacity
    if not base:
        return None
    if role == "prefill":
        if obs.mean_input_tokens is None:
            return None
        hit = obs.prefix_hit_rate if policy.use_prefix_hits else None
        return rules.prefill_tokens(obs.mean_input_tokens, hit) / (base * ps.capacity_scale)
    if obs.mean_output_tokens is None:
        return None
    join = rules.join_seconds(obs.decode_join_seconds, "spec" if configured else "learned", policy.decode_join_seconds)
    return obs.mean_output_tokens / (base * ps.capacity_scale) + join


def note_ready(ps: PoolState, view: PoolView, now: float) -> PoolState:
    """The state with `ready_at` set at the first decision that sees the pool's last change ready."""
    if ps.last_change is None or view.ready < view.current:
        return ps
    if ps.ready_at is not None and ps.ready_at >= ps.last_change:
        return ps
    return replace(ps, ready_at=now)


def changed_within_window(policy: Policy, ps: PoolState, view: PoolView, now: float) -> bool:
    """Whether the pool's capacity changed within the window: its last change was ordered, or seen ready,
    less than a window ago, or pods are still starting. A window that began before then mixes two pool
    sizes: its percentile and queue describe the old one. With pods that start in less than a window the
    order is what counts; with slower ones (minutes with weights to load) the pods arrive after the window
    of the order is over, and their first window still holds the backlog they have just begun to drain."""
    refs = [x for x in (ps.last_change, ps.ready_at) if x is not None]
    ref = max(refs) if refs else None
    return rules.warming_up(now, ref, view.since, view.current, view.ready, policy.window_seconds)


def guard(policy: Policy, obs: Observation | None, ps: PoolState, view: PoolView, role: str, traffic: bool,
          now: float) -> tuple[bool, PoolState]:
    """(does the guard grow this pool now, the pool state with its capacity correction faded or not).

    - More replicas cure queueing, not a slow request: a breach without a queue that adds a real wait in
      front of the pool (one huge prompt is slow on any pool size) is reported but grows nothing; nor does
      one whose queue has drained by the window's end (a burst the pool absorbed: pods ordered now start
      after it).
    - The percentile covers the whole window, so a breach counts once the pool's last change has been
      observed for a window (sooner would count the same breach twice), unless the change is ready and
      its queue alone still waits longer than the target and the ready pool, less what arrivals take,
      cannot work it off within a window (`rules.backlog_clears`: pods ordered for a backlog that is gone
      before they start only stay for a stabilization period).
    - An earlier correction fades while the SLO is met, or while the breach is not one a queue explains."""
    observed, target = targets(policy, obs)[role]
    broken = traffic and rules.breached(observed, target)
    mean, rate = queue_mean(obs, role), (obs.request_rate if obs else None)
    instant = queue_now(obs, role)
    # decode judges its breach by the queue building now too (rules.queue_in_front); prefill by the mean
    curable = broken and rules.guard_applies(rules.queue_in_front(mean, instant) if role == "decode" else mean,
                                             rate, target)
    latest = mean if instant is None else instant
    news = not changed_within_window(policy, ps, view, now) \
        or (rules.backlog_outgrew(view.current, view.ready, rules.queue_wait(latest, rate), target)
            and not rules.backlog_clears(latest, rate, work(policy, obs, ps, role), view.ready, policy.window_seconds))
    fires = curable and rules.still_queued(instant) and news
    if ps.capacity_scale < 1.0 and (not broken and rules.comfortable(observed, target) or broken and not curable):
        ps = replace(ps, capacity_scale=min(1.0, ps.capacity_scale + rules.CAPACITY_RECOVERY))
    return fires, ps
