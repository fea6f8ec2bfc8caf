"""Pure: the autoscaler's per-pool state after a change of the pool's tensor-parallel layout.

Everything the autoscaler remembers about a pool is in units of *instances of its layout*: the learned
capacity (tokens/s of one pod), its SLO correction, and the needs of the stabilization window and the
burst memory (pods needed). A pod at TP 4 is a different instance from a pod at TP 1, so after
`spec.<pool>.tensorParallelSize` changes none of it may be reused: the pool starts afresh, its capacity
from the spec if given, else learned again (CapacityUnknown holds it until a saturated window shows the new
capacity), and the change counts as the pool's last change, so the windows that still saw pods of the old
layout (the rollout) teach nothing (`autoscaler_rules.warming_up`).

A status written before TP existed records no layout: it was learned at TP 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from pdcluster.operator.autoscaler import POOLS, PoolState, State


def pool_for_layout(ps: PoolState, tp: int, now: float) -> PoolState:
    """`ps` if it was observed at TP `tp`, else a fresh state (the SLO-breach counter carries on: it is a
    count for the operator's metric, not a belief about capacity)."""
    if (ps.tensor_parallel or 1) == tp:
        return ps if ps.tensor_parallel == tp else replace(ps, tensor_parallel=tp)
    return PoolState(last_change=now, tensor_parallel=tp, slo_breaches=ps.slo_breaches)


def state_for_layout(state: State, tp: Mapping[str, int], now: float) -> State:
    """The autoscaler State valid for the pools' current TP sizes (`tp`: role -> tensorParallelSize)."""
    pools = {r: pool_for_layout(state.pool(r), int(tp[r]), now) for r in POOLS}
    return State(prefill=pools["prefill"], decode=pools["decode"])
