"""Pure decisions of `pdcluster profile`: where decode throughput stops growing with batch size, which
batch size to recommend, and the `spec.autoscaling.capacity` block to paste.

Why a knee and not the peak: past the knee, a bigger batch buys little throughput but every request's
TPOT keeps growing (each step does more work), so the peak is a bad operating point. We take the
smallest batch that reaches `frac` (90%) of the best measured throughput; it is robust to the noise of
single measurements, unlike marginal-gain rules that stop at the first unlucky point.

When that smallest batch is the largest one measured, throughput was still growing: there is no knee in
the data. The recommendation is then the largest batch measured, and it is reported as that (never as a
knee), with the advice to measure larger batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Knee:
    batch: int  # recommended batch size
    throughput: float  # tokens/s at that batch
    peak_batch: int
    peak_throughput: float
    found: bool  # False: still growing at the largest batch measured, which is then the recommendation
    limited_by_slo: bool = False  # the TPOT objective, not the knee, chose the batch
    slo_unmet: bool = False  # no batch measured met the TPOT objective (the smallest is recommended)

    @property
    def reason(self) -> str:
        """Why this batch, in words (the report and the YAML comment say the same thing)."""
        if self.slo_unmet:
            return "the smallest batch measured: none met --tpot-slo"
        if self.limited_by_slo:
            return "the largest batch within --tpot-slo"
        if self.found:
            return "the knee: larger batches add TPOT, not throughput"
        return "the largest batch measured: throughput was still growing (no knee found)"


def find_knee(points: Sequence[tuple[int, float]], frac: float = 0.9) -> tuple[int, float]:
    """Smallest x whose y reaches `frac` of the maximum y. points: (batch, throughput), any order."""
    pts = sorted((int(x), float(y)) for x, y in points if y is not None and y == y)  # drop None/NaN
    if not pts:
        raise ValueError("no measurements")
    if not 0 < frac <= 1:
        raise ValueError("frac must be in (0, 1]")
    peak = max(y for _, y in pts)
    for x, y in pts:
        if y >= frac * peak:
            return x, y
    raise AssertionError("unreachable: the peak itself qualifies")


def choose_decode_batch(
    points: Sequence[tuple[int, float, float | None]], frac: float = 0.9, tpot_slo: float | None = None
) -> Knee:
    """points: (batch, output tok/s, TPOT seconds or None). The knee, capped by the TPOT objective."""
    if not points:
        raise ValueError("no measurements")
    tp = [(b, t) for b, t, _ in points]
    kb, kt = find_knee(tp, frac)
    peak_b, peak_t = max(tp, key=lambda p: (p[1], -p[0]))
    # A knee only when the smallest batch near the peak is below the largest measured: bigger batches
    # were tried and did not pay. Otherwise kb *is* the largest measured and the curve was still rising.
    found = kb < max(b for b, _ in tp)
    knee = Knee(kb, kt, peak_b, peak_t, found)
    if tpot_slo is None:
        return knee
    ok = [(b, t) for b, t, tpot in points if tpot is not None and tpot <= tpot_slo]
    if not ok:
        smallest = min(points, key=lambda p: p[0])
        return Knee(smallest[0], smallest[1], peak_b, peak_t, found, limited_by_slo=True, slo_unmet=True)
    slo_b, slo_t = max(ok)
    if slo_b < kb:
        return Knee(slo_b, slo_t, peak_b, peak_t, found, limited_by_slo=True)
    return knee


def capacity_yaml(prefill_tps: float | None, decode_tps: float | None, *, max_batch_size: int | None = None,
                  batch_reason: str = "", comment: str = "") -> str:
    """The block to paste into a PDCluster (rounded down: capacity is a promise, not a record)."""
    lines = []
    if comment:
        lines += [f"# {c}" for c in comment.splitlines()]
    lines += ["spec:", "  autoscaling:", "    capacity:"]
    if prefill_tps:
        lines.append(f"      prefillTokensPerSecond: {int(prefill_tps)}")
    if decode_tps:
        lines.append(f"      decodeTokensPerSecond: {int(decode_tps)}")
    if max_batch_size:
        why = f"  # {batch_reason}" if batch_reason else ""
        lines += ["  decode:", f"    maxBatchSize: {max_batch_size}{why}"]
    return "\n".join(lines) + "\n"
