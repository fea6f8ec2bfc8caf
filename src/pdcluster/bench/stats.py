"""Per-request measurements and their per-cell summary (pure; no I/O, no clocks).

TTFT and TPOT are what the *client* sees: TTFT from sending the request to the first streamed token,
TPOT as the mean gap between the remaining tokens, (last - first) / (n - 1). Requests that fail are
counted by kind and kept out of the latency percentiles, so a cell with errors shows both.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

# The columns of results.json / results.csv, in order. Tests and heatmap.py rely on these names.
CELL_FIELDS = [
    "prompt_len",
    "output_len",
    "requests",
    "completed",
    "errors",
    "ttft_p50",
    "ttft_p99",
    "ttft_mean",
    "tpot_p50",
    "tpot_p99",
    "tpot_mean",
    "latency_p50",
    "latency_p99",
    "output_tokens_per_second",
    "prompt_tokens_per_second",
    "requests_per_second",
    "mean_output_tokens",
    "wall_seconds",
    "error_kinds",
]


@dataclass
class RequestResult:
    ok: bool
    start: float = 0.0  # seconds, on the load generator's monotonic clock
    ttft: float | None = None
    latency: float | None = None  # send -> last byte
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None  # a short kind: connect, timeout, http_429, http_500, stream_error, ...
    detail: str = ""  # the server's message, truncated; for the report, not for grouping
    itl: list[float] = field(default_factory=list)  # gaps between token chunks, seconds

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        d = asdict(self)
        d["tpot"] = self.tpot
        d.pop("itl")  # can be long; the mean is in tpot
        return d


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no data. q in [0, 100]."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError("q must be in [0, 100]")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize_cell(
    prompt_len: int, output_len: int, results: Sequence[RequestResult], wall_seconds: float
) -> dict:
    """One results.json cell. Throughputs are over the cell's wall time (first send to last reply)."""
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    lats = [r.latency for r in ok if r.latency is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    wall = wall_seconds if wall_seconds > 0 else float("nan")
    kinds = Counter(r.error or "unknown" for r in results if not r.ok)
    cell = {
        "prompt_len": prompt_len,
        "output_len": output_len,
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "ttft_mean": _mean(ttfts),
        "tpot_p50": percentile(tpots, 50),
        "tpot_p99": percentile(tpots, 99),
        "tpot_mean": _mean(tpots),
        "latency_p50": percentile(lats, 50),
        "latency_p99": percentile(lats, 99),
        "output_tokens_per_second": _finite(out_tokens / wall) if ok else 0.0,
        "prompt_tokens_per_second": _finite(in_tokens / wall) if ok else 0.0,
        "requests_per_second": _finite(len(ok) / wall) if ok else 0.0,
        "mean_output_tokens": out_tokens / len(ok) if ok else None,
        "wall_seconds": wall_seconds,
        "error_kinds": dict(sorted(kinds.items())),
    }
    return cell


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def parse_int_list(text: str) -> list[int]:
    """'128,512, 2048' -> [128, 512, 2048]; raises ValueError with a readable message."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            v = int(part)
        except ValueError:
            raise ValueError(f"not an integer: {part!r}") from None
        if v < 1:
            raise ValueError(f"lengths must be >= 1, got {v}")
        out.append(v)
    if not out:
        raise ValueError("empty list")
    return out
