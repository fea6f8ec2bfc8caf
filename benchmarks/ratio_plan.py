"""Pure decisions of the ratio sweep (`benchmarks/ratio_sweep.py`): which P:D splits a worker budget allows,
the split the planner's formula picks, and goodput (requests/s that met the SLOs) from a replay's records.

Why goodput and not throughput: every split finishes the same requests eventually (the replay is open
loop), so what separates a good split from a bad one is how many requests it answers *in time*. A request
counts when it succeeded, its TTFT is within the TTFT objective and, when it produced two tokens or more,
its TPOT is within the TPOT objective (one-token answers have no TPOT, as in `pdcluster.bench.stats`).
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
    prefill: int  # the planner's split of the budget: (0, N) when its advice is to colocate
    decode: int
    prefill_seconds: float  # I / C_p: one prefill instance's seconds per request
    decode_seconds: float  # O / C_d + t_join: one decode instance's seconds per request
    ideal_prefill: float  # the fractional prefill count the formula asks for within the budget
    decode_join_seconds: float = 0.0  # t_join, the part of decode_seconds that is per request, not per token
    colocate: bool = False  # the planner's advice: disaggregation does not pay (`colocation_advice`)
    disaggregated: tuple[int, int] | None = None  # the nearest disaggregated split (the formula's ratio alone)
    rule: str | None = None  # which colocation rule fired

    @property
    def ratio(self) -> float:
        """D/P as the planner reports it: (O/C_d) / (I/C_p)."""
        return self.decode_seconds / self.prefill_seconds


def formula_split(workers: int, input_len: float, output_len: float, prefill_capacity: float,
                  decode_capacity: float, decode_join_seconds: float = 0.0,
                  slo_tpot: float | None = None) -> FormulaSplit:
    """The planner's answer for a budget of `workers`: colocated (0, N) when its advice says colocate (with
    `slo_tpot`, also when a prompt's prefill fits within the TPOT objective), else the disaggregated split
    (both pools >= 1) whose D/P is nearest to (O/C_d + t_join)/(I/C_p) in log terms (a 2x error counts the
    same either way). `disaggregated` is that nearest split in both cases."""
    sp, sd = seconds_per_request(input_len, output_len, prefill_capacity, decode_capacity, decode_join_seconds)
    target = sd / sp
    best = min(((p, d) for p, d in splits(workers, colocated=False)),
               key=lambda s: (abs(math.log((s[1] / s[0]) / target)), -s[0]))
    advice = colocation_advice(sp, sd, workers, slo_tpot)
    chosen = (0, workers) if advice["colocate"] else best
    return FormulaSplit(chosen[0], chosen[1], sp, sd, workers * sp / (sp + sd), decode_join_seconds,
                        bool(advice["colocate"]), best, advice["rule"])


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


def pick_speedup(scan: Iterable[tuple[float, float]], min_attainment: float = 0.8) -> float:
    """The load of the sweep, from a scan of (speedup, share of requests within SLO) of the split expected to
    be best: the highest speedup at which it still answers `min_attainment` of the requests within SLO.
    Below that the splits cannot be told apart (every one meets the SLO: the 0.5x sweep); far above it every
    split collapses and goodput measures the collapse, not capacity (the 6x sweep). None qualifies: the
    lowest scanned (and the caller says so)."""
    pts = sorted(scan)
    if not pts:
        raise ValueError("the rate scan measured nothing")
    ok = [s for s, a in pts if a >= min_attainment]
    return max(ok) if ok else pts[0][0]


def share_of_best(mean: Mapping[tuple[int, int], float], split: tuple[int, int],
                  among: Iterable[tuple[int, int]] | None = None) -> float | None:
    """`split`'s mean goodput over the best mean among `among` (default: all measured splits)."""
    cands = [s for s in (among if among is not None else mean) if s in mean]
    if split not in mean or not cands:
        return None
    best = max(mean[s] for s in cands)
    return mean[split] / best if best > 0 else 1.0
