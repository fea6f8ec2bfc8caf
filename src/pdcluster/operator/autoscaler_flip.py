"""Pure: role flips (prefill <-> decode without a restart) as a scaling action on a decision.

A flip moves a running worker to the other pool: it stops admitting work for its old role, finishes what
it holds, keeps its weights and serves the new role seconds later, where a new pod takes a pod start
(minutes with weights to load). So when one pool is short and the other has **slack** (more replicas than
its recommendation, e.g. held by scale-down stabilization), the short pool takes the slack by flips
first and starts pods only for what is left.

- short = desired - current of the growing pool (the decision's own step, so step limits, bounds and the
  SLO guard already apply);
- slack = current - max(recommended, minReplicas) of the other pool: never below what the formula asks
  for it now, so a flip never takes capacity the other pool needs; a pool without a recommendation
  (metrics or capacity unknown) has no slack; the other pool ends at min(its desired, current - flips);
- flips = min(short, slack), fewer if `spec.autoscaling.ratio` would not hold after them.

`pdcluster simulate`'s `pdcluster` policy acts on this decision (`pdcluster-no-flips` does not); the operator
carries it out on pods with `spec.roleFlips` (`applied` here, then operator/flips.py and flip_pods.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from pdcluster.operator import autoscaler as asc

FLIP = "RoleFlip"  # reason of a decision carried out (partly) by flips
# reason of a flip-only decision on a short window (autoscaler_flip_window)
FLIP_WINDOW = "RoleFlipShortWindow"


@dataclass(frozen=True)
class FlipPlan:
    prefill: int  # sizes after the step, flips included
    decode: int
    to_prefill: int = 0  # decode workers that become prefill workers
    to_decode: int = 0  # prefill workers that become decode workers

    @property
    def flips(self) -> int:
        return self.to_prefill + self.to_decode


def slack(other: asc.PoolDecision, min_replicas: int) -> int:
    """Replicas of `other` above its recommendation and its minimum (0 without a recommendation)."""
    if other.recommended is None:
        return 0
    return max(0, other.current - max(other.recommended, min_replicas))


def plan(decision: asc.Decision, policy: asc.Policy, keep: Mapping[str, int] | None = None) -> FlipPlan:
    """The decision's sizes, with the short pool's growth taken from the other's slack by flips. `keep`: per
    pool, what a trusted short window (autoscaler_flip_window) asks it to keep: no flip takes a worker below
    it, so a long window that lags a turn of the mix cannot flip back what the short window moved."""
    p, d = decision.prefill, decision.decode
    want_p, want_d = p.desired, d.desired
    for short, other, direction in ((p, d, "to_prefill"), (d, p, "to_decode")):
        grow = short.desired - short.current
        if grow <= 0 or other.desired > other.current:
            continue
        lo, _ = policy.bounds.of("decode" if direction == "to_prefill" else "prefill")
        n = min(grow, slack(other, lo))
        if keep is not None:
            n = min(n, max(0, other.current - keep["decode" if direction == "to_prefill" else "prefill"]))
        while n > 0:
            other_after = min(other.desired, other.current - n)
            sizes = (short.desired, other_after) if direction == "to_prefill" else (other_after, short.desired)
            if policy.ratio.holds(*sizes):
                break
            n -= 1
        if n > 0:
            other_after = min(other.desired, other.current - n)
            if direction == "to_prefill":
                return FlipPlan(want_p, other_after, to_prefill=n)
            return FlipPlan(other_after, want_d, to_decode=n)
    return FlipPlan(want_p, want_d)


def applied(decision: asc.Decision, policy: asc.Policy, keep: Mapping[str, int] | None = None) -> asc.Decision:
    """The decision with its flips planned in: each pool's desired size from `plan`, reason `RoleFlip` when
    there is a flip (its pools' cause is then `flip`: autoscaler_explain). Unchanged without flips."""
    fp = plan(decision, policy, keep)
    if not fp.flips:
        return decision
    return replace(decision, prefill=replace(decision.prefill, desired=fp.prefill),
                   decode=replace(decision.decode, desired=fp.decode), reason=FLIP)
