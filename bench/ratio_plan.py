"""Pure decisions of the ratio sweep (`bench/ratio_sweep.py`): which P:D splits a worker budget allows,
the split the planner's formula picks, and goodput (requests/s that met the SLOs) from a replay's records.

Why goodput and not throughput: every split finishes the same requests eventually (the replay is open
loop), so what separates a good split from a bad one is how many requests it answers *in time*. A request
counts when it succeeded, its TTFT is within the TTFT objective and, when it produced two tokens or more,
its TPOT is within the TPOT objective (one-token answers have no TPOT, as in `bench/stats.py`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pdcluster.operator.planner import colocation_advice, seconds_per_request


def splits(workers: int, colocated: bool = True) -> list[tuple[int, int]]:
    """Every (prefill, decode) split of `workers`, prefill ascending; decode keeps at least one worker.
    (0, N) is the colocated cluster (`pdcluster up --prefill 0`: decode workers prefill everything)."""
    if workers < 2:
        raise ValueError(f"a P:D split needs at least 2 workers (got {workers})")
    return [(p, workers - p) for p in range(0 if colocated else 1, workers)]


@dataclass(frozen=True)
class FormulaSplit:
    prefill: int
    decode: int
    prefill_seconds: float  # I / C_p: one prefill instance's seconds per request
    decode_seconds: float  # O / C_d + t_join: one decode instance's seconds per request
    ideal_prefill: float  # the fractional prefill count the formula asks for within the budget
    decode_join_seconds: float = 0.0  # t_join, the part of decode_seconds that is per request, not per token
    colocate: bool = False  # the planner's advice: the ideal decode pool is too small to pay for itself

    @property
    def ratio(self) -> float:
        """D/P as the planner reports it: (O/C_d) / (I/C_p)."""
        return self.decode_seconds / self.prefill_seconds


def formula_split(workers: int, input_len: float, output_len: float, prefill_capacity: float,
                  decode_capacity: float, decode_join_seconds: float = 0.0) -> FormulaSplit:
    """The planner's ratio fitted into `workers`: the disaggregated split (both pools >= 1) whose D/P is
    nearest to (O/C_d + t_join)/(I/C_p) in log terms (a 2x error counts the same either way); `colocate`
    is the planner's advice for this budget (then the split is still the nearest disaggregated one)."""
    sp, sd = seconds_per_request(input_len, output_len, prefill_capacity, decode_capacity, decode_join_seconds)
    target = sd / sp
    best = min(((p, d) for p, d in splits(workers, colocated=False)),
               key=lambda s: (abs(math.log((s[1] / s[0]) / target)), -s[0]))
    return FormulaSplit(best[0], best[1], sp, sd, workers * sp / (sp + sd), decode_join_seconds,
                        bool(colocation_advice(sp, sd, workers)["colocate"]))


def within_slo(rec: Mapping[str, object], slo_ttft: float, slo_tpot: float) -> bool:
    """One replay record (a line of requests.jsonl) met both objectives."""
    if not rec.get("ok"):
        return False
    ttft, tpot = rec.get("ttft"), rec.get("tpot")
    if not isinstance(ttft, int | float) or ttft > slo_ttft:
        return False
    return tpot is None or (isinstance(tpot, int | float) and tpot <= slo_tpot)


def goodput(records: Sequence[Mapping[str, object]], slo_ttft: float, slo_tpot: float,
            duration_s: float) -> dict[str, float | int]:
    """Requests/s within SLO over the slice's (time-scaled) span, with the counts behind it."""
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0 (got {duration_s})")
    good = sum(1 for r in records if within_slo(r, slo_ttft, slo_tpot))
    ok = sum(1 for r in records if r.get("ok"))
    n = len(records)
    return {"requests": n, "ok": ok, "failed": n - ok, "within_slo": good,
            "attainment": good / n if n else 0.0, "goodput_rps": good / duration_s}


@dataclass(frozen=True)
class SweepVerdict:
    mean_goodput: dict[tuple[int, int], float]  # split -> mean over rounds
    best: tuple[int, int]
    formula: tuple[int, int]
    formula_share_of_best: float  # formula's mean goodput / best's
    met: bool  # within `tolerance` of the best


def verdict(runs: Iterable[tuple[tuple[int, int], float]], formula: tuple[int, int],
            tolerance: float = 0.10) -> SweepVerdict:
    """runs: (split, goodput) for every split and round. The formula's split meets the goal when its mean
    goodput is at least (1 - tolerance) of the best split's mean."""
    per: dict[tuple[int, int], list[float]] = {}
    for split, g in runs:
        per.setdefault(split, []).append(g)
    if formula not in per:
        raise ValueError(f"the formula's split {formula} was not measured")
    mean = {s: sum(v) / len(v) for s, v in per.items()}
    best = max(mean, key=lambda s: (mean[s], -s[0]))
    share = mean[formula] / mean[best] if mean[best] > 0 else 1.0
    return SweepVerdict(mean, best, formula, share, share >= 1.0 - tolerance)
