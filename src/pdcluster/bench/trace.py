"""Production request traces as a workload: readers, scaling, windows and a summary (pure, no I/O but reading).

Two schemas, any file of either (the schema is recognised from the content, not the file name):

- Azure LLM inference trace (Splitwise, ISCA 2024): CSV with a header naming `TIMESTAMP`,
  `ContextTokens`, `GeneratedTokens` (any column order, any case); timestamps are wall-clock
  (`2023-11-16 18:17:03.9799600`, fractional digits beyond microseconds are dropped) or plain seconds.
- Mooncake (FAST 2025): JSON lines with `timestamp` (ms from the start), `input_length`, `output_length`
  and optionally `hash_ids` (ids of 512-token prompt blocks; equal ids = a shareable prefix).

Every request keeps its arrival offset in seconds from the first request, so a trace always starts at 0.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512
_AZURE_COLUMNS = {"timestamp": "TIMESTAMP", "context": "ContextTokens", "generated": "GeneratedTokens"}


class TraceError(ValueError):
    """A file that is not a readable trace of a known schema (the message names file and line)."""


@dataclass(frozen=True)
class Request:
    t: float  # arrival, seconds from the trace's start
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] | None = None  # prefix blocks (Mooncake); None when the schema has none


@dataclass(frozen=True)
class Trace:
    requests: tuple[Request, ...]
    schema: str  # "azure" | "mooncake"
    source: str
    block_tokens: int = MOONCAKE_BLOCK_TOKENS  # tokens per hash_ids block (shrinks with length scaling)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].t if self.requests else 0.0


# ---- readers -----------------------------------------------------------------------------------------

def _parse_time(value: str) -> float:
    """Wall-clock `YYYY-MM-DD HH:MM:SS[.fffffff]` (UTC) or plain seconds -> epoch seconds."""
    v = value.strip()
    try:
        return float(v)
    except ValueError:
        pass
    frac = 0.0
    if "." in v:
        v, digits = v.split(".", 1)
        digits = digits.rstrip("Z")
        if not digits.isdigit():
            raise ValueError(f"bad timestamp {value!r}")
        frac = int(digits) / 10 ** len(digits)
    dt = datetime.fromisoformat(v.replace("T", " ").rstrip("Z"))
    return dt.timestamp() + frac


def _count(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a non-negative integer (got {value!r})")
    n = float(value) if isinstance(value, int | float) else float(str(value).strip())
    if not math.isfinite(n) or n < 0 or n != int(n):
        raise ValueError(f"{what} must be a non-negative integer (got {value!r})")
    return int(n)


def read_azure(text: str, source: str = "<csv>") -> Trace:
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if not header:
        raise TraceError(f"{source}: empty file")
    names = {h.strip().lower(): i for i, h in enumerate(header)}
    idx = {}
    for key, col in _AZURE_COLUMNS.items():
        if col.lower() not in names:
            raise TraceError(f"{source}: not an Azure trace CSV: header lacks {col!r} "
                             f"(expected {', '.join(_AZURE_COLUMNS.values())})")
        idx[key] = names[col.lower()]
    rows: list[tuple[float, int, int]] = []
    for lineno, row in enumerate(reader, start=2):
        if not row or all(not c.strip() for c in row):
            continue
        try:
            rows.append((_parse_time(row[idx["timestamp"]]), _count(row[idx["context"]], "ContextTokens"),
                         _count(row[idx["generated"]], "GeneratedTokens")))
        except (ValueError, IndexError) as e:
            raise TraceError(f"{source}:{lineno}: {e}") from None
    return _build(rows, [None] * len(rows), "azure", source)


def read_mooncake(text: str, source: str = "<jsonl>") -> Trace:
    rows: list[tuple[float, int, int]] = []
    hashes: list[tuple[int, ...] | None] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("line is not a JSON object")
            missing = [k for k in ("timestamp", "input_length", "output_length") if k not in obj]
            if missing:
                raise ValueError(f"not a Mooncake trace line: missing {', '.join(missing)}")
            ts = float(obj["timestamp"])
            if not math.isfinite(ts):
                raise ValueError("timestamp is not finite")
            h = obj.get("hash_ids")
            if h is not None and not (isinstance(h, list) and all(isinstance(x, int) for x in h)):
                raise ValueError("hash_ids must be a list of integers")
            rows.append((ts / 1000.0, _count(obj["input_length"], "input_length"),
                         _count(obj["output_length"], "output_length")))
            hashes.append(tuple(h) if h is not None else None)
        except (ValueError, TypeError) as e:
            raise TraceError(f"{source}:{lineno}: {e}") from None
    return _build(rows, hashes, "mooncake", source)


def _build(rows: list[tuple[float, int, int]], hashes: list[tuple[int, ...] | None], schema: str,
           source: str) -> Trace:
    if not rows:
        raise TraceError(f"{source}: no requests in the trace")
    order = sorted(range(len(rows)), key=lambda i: rows[i][0])  # stable: equal timestamps keep file order
    t0 = rows[order[0]][0]
    reqs = tuple(Request(rows[i][0] - t0, rows[i][1], rows[i][2], hashes[i]) for i in order)
    return Trace(reqs, schema, source)


def parse_trace(text: str, source: str = "<trace>") -> Trace:
    """Recognise the schema from the first non-blank character: `{` = Mooncake JSONL, else Azure CSV."""
    head = text.lstrip()
    if not head:
        raise TraceError(f"{source}: empty file")
    return read_mooncake(text, source) if head.startswith("{") else read_azure(text, source)


def read_trace(path: str | Path) -> Trace:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TraceError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise TraceError(f"{p}: is a directory, not a trace file") from None
    except UnicodeDecodeError:
        raise TraceError(f"{p}: not a text file (expected an Azure CSV or Mooncake JSONL trace)") from None
    except OSError as e:
        raise TraceError(f"{p}: {e.strerror or e}") from None
    return parse_trace(text, str(p))


# ---- transformations ---------------------------------------------------------------------------------

def scale_time(trace: Trace, speedup: float) -> Trace:
    """Replay `speedup` times faster (2 = the same requests in half the time)."""
    if not math.isfinite(speedup) or speedup <= 0:
        raise TraceError(f"speedup must be > 0 (got {speedup})")
    return replace(trace, requests=tuple(replace(r, t=r.t / speedup) for r in trace.requests))


def scale_lengths(trace: Trace, max_model_len: int) -> Trace:
    """Shrink prompt and output lengths by one factor so the longest request fits `max_model_len`.

    One factor for all keeps the trace's length mix (and the P:D ratio it implies); prefix blocks shrink
    by the same factor, so shared `hash_ids` still cover the same share of each prompt. A no-op when
    everything already fits.
    """
    if max_model_len < 2:
        raise TraceError(f"max model length must be >= 2 (got {max_model_len})")
    longest = max(r.input_tokens + r.output_tokens for r in trace.requests)
    if longest <= max_model_len:
        return trace
    f = max_model_len / longest

    def one(r: Request) -> Request:
        i, o = max(1, round(r.input_tokens * f)), max(1, round(r.output_tokens * f))
        while i + o > max_model_len:  # rounding may overshoot by a token
            i, o = (i - 1, o) if i >= o else (i, o - 1)
        return replace(r, input_tokens=i, output_tokens=o)

    return replace(trace, requests=tuple(one(r) for r in trace.requests),
                   block_tokens=max(1, round(trace.block_tokens * f)))


def fit_prompts(trace: Trace, max_model_len: int, max_output: int) -> Trace:
    """Keep output lengths real (clipped to `max_output`) and shrink prompts alone, by one factor, so the
    longest prompt fits `max_model_len - max_output`.

    `scale_lengths` shrinks outputs with prompts, which crushes a trace with long prompts (the Azure code
    trace: 2,048 in / 28 out becomes ~300 / ~3 for 1,024 tokens) into one with almost no decode; this keeps
    the decode work a request really asks for. Prefix blocks shrink with the prompts.
    """
    if max_output < 1 or max_model_len < max_output + 1:
        raise TraceError(f"need max model length > max output >= 1 (got {max_model_len} and {max_output})")
    room = max_model_len - max_output
    longest = max(r.input_tokens for r in trace.requests)
    f = min(1.0, room / longest) if longest > 0 else 1.0

    def one(r: Request) -> Request:
        i = min(room, max(1, round(r.input_tokens * f)))
        return replace(r, input_tokens=i, output_tokens=max(1, min(max_output, r.output_tokens)))

    return replace(trace, requests=tuple(one(r) for r in trace.requests),
                   block_tokens=max(1, round(trace.block_tokens * f)))


def time_window(trace: Trace, start_s: float = 0.0, end_s: float | None = None) -> Trace:
    """Requests arriving in [start_s, end_s), re-based to start at 0."""
    if start_s < 0 or (end_s is not None and end_s <= start_s):
        raise TraceError(f"bad time window [{start_s}, {end_s})")
    kept = [r for r in trace.requests if r.t >= start_s and (end_s is None or r.t < end_s)]
    if not kept:
        raise TraceError(f"{trace.source}: no requests in the window [{start_s}, {end_s})")
    t0 = kept[0].t
    return replace(trace, requests=tuple(replace(r, t=r.t - t0) for r in kept))


# ---- summary ---------------------------------------------------------------------------------------------

def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    xs = sorted(values)
    if not xs:
        return 0.0
    k = max(1, math.ceil(q / 100.0 * len(xs)))
    return float(xs[min(k, len(xs)) - 1])


def peak_minute(trace: Trace) -> int:
    """Most requests arriving in any 60 s sliding window."""
    ts = [r.t for r in trace.requests]
    best, lo = 0, 0
    for hi, t in enumerate(ts):
        while ts[lo] <= t - 60.0:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def summarize(trace: Trace) -> dict:
    ins = [r.input_tokens for r in trace.requests]
    outs = [r.output_tokens for r in trace.requests]
    n = len(trace.requests)
    dur = trace.duration_s
    peak = peak_minute(trace)
    return {
        "source": trace.source,
        "schema": trace.schema,
        "requests": n,
        "duration_s": dur,
        "mean_rate_rps": n / dur if dur > 0 else None,
        "peak_minute_requests": peak,
        "peak_minute_rate_rps": peak / 60.0,
        "mean_input_tokens": sum(ins) / n,
        "p50_input_tokens": percentile(ins, 50),
        "p99_input_tokens": percentile(ins, 99),
        "mean_output_tokens": sum(outs) / n,
        "p50_output_tokens": percentile(outs, 50),
        "p99_output_tokens": percentile(outs, 99),
        "has_prefix_hashes": any(r.hash_ids for r in trace.requests),
    }
