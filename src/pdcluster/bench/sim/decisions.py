"""The decision log of a `Core` policy (`pdcluster simulate --decisions`): one row per autoscaler tick with
what the operator's `decide` saw (rate, lengths, queues, latency percentiles), the pools as they stood and
what it decided, so that a domination can be traced to the window where it began."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from pdcluster.operator.autoscaler import Decision, Observation, PoolView

OBSERVED = ("request_rate", "peak_request_rate", "mean_input_tokens", "mean_output_tokens", "prefill_queue_mean",
            "prefill_queue_now", "decode_queue_mean", "decode_queue_now", "ttft_seconds", "tpot_seconds",
            "prompt_length_scv")
# what decide computed from them (its `inputs`): the pools' needs, unrounded, headroom included
NEEDS = ("prefillNeed", "prefillTailNeed", "prefillBurstNeed", "decodeNeed", "decodeBurstNeed")
# what holds a pool up against scale-down: the highest need of the stabilization window and of the remembered
# bursts (the pool state's max_need), unrounded
HELD = ("prefill_held_need", "decode_held_need")
COLUMNS = ("t", *OBSERVED, *(f"{r}_{k}" for r in ("prefill", "decode")
                            for k in ("current", "ready", "recommended", "desired", "reason")), *NEEDS, *HELD,
           "reason")


def row(now: float, obs: Observation | None, prefill: PoolView, decode: PoolView, d: Decision) -> dict[str, Any]:
    out: dict[str, Any] = {"t": round(now, 3)}
    for k in OBSERVED:
        v = getattr(obs, k) if obs is not None else None
        out[k] = None if v is None else round(float(v), 4)
    for role, view in (("prefill", prefill), ("decode", decode)):
        p = d.pool(role)
        out.update({f"{role}_current": view.current, f"{role}_ready": view.ready,
                    f"{role}_recommended": p.recommended, f"{role}_desired": p.desired, f"{role}_reason": p.reason})
    for k in NEEDS:
        v = d.inputs.get(k)
        out[k] = None if v is None else round(float(v), 4)
    for role in ("prefill", "decode"):
        held = d.state.pool(role).max_need
        out[f"{role}_held_need"] = None if held is None else round(held, 4)
    out["reason"] = d.reason
    return out


def write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    return path
