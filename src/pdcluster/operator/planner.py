"""The P:D formula and the KV-cache budget: pure functions shared by the autoscaler and the CLI.

Per request, prefill spends `I / C_p` seconds of one prefill instance and decode spends `O / C_d + t_join`
seconds of one decode instance (I, O: mean input/output tokens; C_p, C_d: prompt/output tokens per second one
instance sustains; t_join: the decode instance-seconds of admitting one transferred request — KV import,
scheduling, its first step — which C_d, measured on sequences already decoding, leaves out; measured by
`pdcluster profile` or live from `pdcluster_decode_join_seconds`, 0 when unknown). At a request rate λ the
pools need `λ·I/C_p` and `λ·(O/C_d + t_join)` instances; with headroom h (1.5: provision for 1.5x the
observed rate):

    P = ceil(h·λ·I / C_p)        D = ceil(h·λ·(O / C_d + t_join))        ratio D/P = (O/C_d + t_join) / (I/C_p)

then clamped to [min, max] per pool, and, when a total budget is set, both scaled down together so the
ratio holds within the budget. When the decode share of the work is so small that the budget's ideal decode
pool is under half an instance, or (given a TPOT objective) one prompt's prefill I/C_p fits within it so
colocated decode would meet it anyway, `colocation_advice` says that disaggregation does not pay: colocate.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

# A tiny tolerance so 12.000000000001 (float noise) does not become 13.
_EPS = 1e-9


class PlanError(ValueError):
    """Invalid planner input (zero capacity, negative lengths, ...)."""


@dataclass(frozen=True)
class Bounds:
    min_prefill: int = 1
    max_prefill: int | None = None
    min_decode: int = 1
    max_decode: int | None = None
    max_total: int | None = None

    def validate(self) -> None:
        for name in ("min_prefill", "min_decode"):
            if getattr(self, name) < 0:
                raise PlanError(f"{name.replace('_', '-')} must be >= 0")
        for lo, hi in (("min_prefill", "max_prefill"), ("min_decode", "max_decode")):
            top = getattr(self, hi)
            if top is not None and top < getattr(self, lo):
                raise PlanError(f"{hi.replace('_', '-')} must be >= {lo.replace('_', '-')}")
        if self.max_total is not None and self.max_total < self.min_prefill + self.min_decode:
            raise PlanError("max-total-replicas must be >= min-prefill + min-decode")

    def of(self, role: str) -> tuple[int, int | None]:
        """(min, max) of one pool, `role` being "prefill" or "decode"."""
        if role == "prefill":
            return self.min_prefill, self.max_prefill
        if role == "decode":
            return self.min_decode, self.max_decode
        raise ValueError(f"no replica bounds for role {role!r}")

    def clamp(self, role: str, replicas: int) -> int:
        return clamp_replicas(replicas, *self.of(role))


@dataclass(frozen=True)
class Plan:
    prefill_seconds_per_request: float
    decode_seconds_per_request: float
    ratio: float  # decode instances per prefill instance, unclamped
    prefill_replicas: int | None
    decode_replicas: int | None
    raw_prefill: float | None  # h·λ·I/C_p before ceil and clamps
    raw_decode: float | None
    limited: bool
    limited_by: list[str] = field(default_factory=list)
    inputs: dict[str, Any] = field(default_factory=dict)
    advice: dict[str, Any] = field(default_factory=dict)  # colocation_advice(): colocate or not

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _positive(name: str, value: float) -> float:
    if value is None or not math.isfinite(value) or value <= 0:
        raise PlanError(f"{name} must be a positive number (got {value})")
    return float(value)


def seconds_per_request(input_len: float, output_len: float, prefill_capacity: float,
                        decode_capacity: float, decode_join_seconds: float = 0.0) -> tuple[float, float]:
    """(I/C_p, O/C_d + t_join): one prefill and one decode instance's seconds per request."""
    i = _positive("input-len", input_len)
    o = _positive("output-len", output_len)
    cp = _positive("prefill-capacity", prefill_capacity)
    cd = _positive("decode-capacity", decode_capacity)
    tj = decode_join_seconds
    if tj is None or not math.isfinite(tj) or tj < 0:
        raise PlanError(f"decode-join-seconds must be >= 0 (got {tj})")
    return i / cp, o / cd + tj


# Below this many instances of ideal decode pool in the budget, a dedicated decode pool idles more than half
# its time while costing prefill a whole instance: colocated workers (each prefills and decodes) do better.
COLOCATE_BELOW_DECODE = 0.5


def colocation_advice(prefill_seconds: float, decode_seconds: float, budget: int | None,
                      slo_tpot: float | None = None) -> dict[str, Any]:
    """Does disaggregation pay for this work mix within a budget of `budget` instances? Two rules, either one
    says colocate (`pdcluster up --prefill 0`, or role=both workers):
    - small decode: the fractional split of the budget by work share gives an ideal decode pool under
      COLOCATE_BELOW_DECODE of an instance;
    - nothing to protect (with a TPOT objective): what disaggregation buys is decode steps that never wait for
      a prefill. On a colocated instance a decoding request waits at worst for one prompt's prefill between
      two of its tokens, I/C_p seconds; when that fits within the TPOT objective, colocated instances meet
      TPOT anyway and disaggregation only costs the KV transfer, the admission work and the integer split of
      the budget (the ratio sweeps: colocated won every quiet sweep with I/C_p 0.09-0.23 s under a 0.5 s
      TPOT objective; docs/operator.md).
    No budget: the share only, no verdict."""
    share = decode_seconds / (prefill_seconds + decode_seconds)
    if budget is None or budget < 1:
        return {"decode_share": share, "budget": None, "ideal_decode": None, "colocate": None, "rule": None,
                "message": f"decode is {100 * share:.3g} % of the work per request"}
    ideal = budget * share
    small = ideal < COLOCATE_BELOW_DECODE
    unprotected = slo_tpot is not None and prefill_seconds <= slo_tpot
    rule = "small-decode" if small else "prefill-within-tpot" if unprotected else None
    why = (f"decode is {100 * share:.3g} % of the work: of {budget} instances the ideal decode pool is "
           f"{ideal:.2g}; ")
    if small:
        why += "disaggregation does not pay at this ratio and budget: colocate"
    elif unprotected:
        why += (f"a prompt's prefill ({prefill_seconds:.3g} s) fits within the TPOT objective ({slo_tpot:g} s), "
                "so colocated decode meets it anyway and disaggregation only costs transfers: colocate")
    else:
        why += "disaggregate"
    if rule:
        why += " (`pdcluster up --prefill 0`, or workers with role both)"
    return {"decode_share": share, "budget": budget, "ideal_decode": ideal, "colocate": rule is not None,
            "rule": rule, "message": why}


def replicas_for(load: float) -> int:
    """ceil() that ignores float noise below 1e-9."""
    if load <= 0:
        return 0
    return max(0, math.ceil(load - _EPS))


def clamp_replicas(replicas: int, lo: int, hi: int | None) -> int:
    """The one per-pool replica clamp (planner, autoscaler and reconciler all use it): [lo, hi], hi=None
    meaning unbounded. The schema guarantees lo <= hi; should both ever cross, the minimum wins."""
    if hi is not None and replicas > hi:
        replicas = hi
    return max(lo, replicas)


def clamp_pair(p: int, d: int, bounds: Bounds) -> tuple[int, int, list[str]]:
    """Clamp to per-pool bounds, then fit into the total budget keeping the D/P ratio."""
    limited: list[str] = []
    raw = {"prefill": p, "decode": d}
    clamped = {r: bounds.clamp(r, n) for r, n in raw.items()}
    limited += [f"min-{r}" for r in raw if clamped[r] > raw[r]]
    limited += [f"max-{r}" for r in raw if clamped[r] < raw[r]]
    p, d = clamped["prefill"], clamped["decode"]
    budget = bounds.max_total
    if budget is not None and p + d > budget:
        limited.append("max-total-replicas")
        p, d = fit_budget(p, d, budget, bounds.min_prefill, bounds.min_decode)
    return p, d, limited


def fit_budget(p: int, d: int, budget: int, min_p: int = 1, min_d: int = 1) -> tuple[int, int]:
    """Scale (p, d) down proportionally so p + d <= budget, keeping each >= its minimum.

    Among the splits of the budget, pick the one whose ratio d/p is closest to the requested one;
    prefer using the whole budget.
    """
    if p + d <= budget:
        return p, d
    target = d / p if p > 0 else math.inf
    best: tuple[float, int, int] | None = None
    for pp in range(max(min_p, 0), budget - min_d + 1):
        dd = budget - pp
        if pp > p or dd > d:
            continue
        r = dd / pp if pp > 0 else math.inf
        err = abs(math.log(r / target)) if 0 < r < math.inf and 0 < target < math.inf else math.inf
        cand = (err, pp, dd)
        if best is None or cand[0] < best[0]:
            best = cand
    if best is None:  # unreachable when budget >= min_p + min_d and p >= min_p, d >= min_d
        return min_p, max(min_d, budget - min_p)
    return best[1], best[2]


def plan(
    *,
    input_len: float,
    output_len: float,
    prefill_capacity: float,
    decode_capacity: float,
    request_rate: float | None = None,
    headroom: float = 1.5,
    bounds: Bounds | None = None,
    decode_join_seconds: float = 0.0,
    slo_tpot: float | None = None,
) -> Plan:
    bounds = bounds or Bounds()
    bounds.validate()
    sp, sd = seconds_per_request(input_len, output_len, prefill_capacity, decode_capacity, decode_join_seconds)
    if headroom is None or not math.isfinite(headroom) or headroom < 1.0:
        raise PlanError(f"headroom must be >= 1.0 (got {headroom})")
    if request_rate is not None and (not math.isfinite(request_rate) or request_rate < 0):
        raise PlanError(f"request-rate must be >= 0 (got {request_rate})")
    inputs = {
        "input_len": input_len,
        "output_len": output_len,
        "prefill_capacity": prefill_capacity,
        "decode_capacity": decode_capacity,
        "decode_join_seconds": decode_join_seconds,
        "request_rate": request_rate,
        "headroom": headroom,
        "min_prefill": bounds.min_prefill,
        "max_prefill": bounds.max_prefill,
        "min_decode": bounds.min_decode,
        "max_decode": bounds.max_decode,
        "max_total_replicas": bounds.max_total,
        "slo_tpot": slo_tpot,
    }
    ratio = sd / sp
    if request_rate is None:
        return Plan(sp, sd, ratio, None, None, None, None, False, [], inputs,
                    colocation_advice(sp, sd, bounds.max_total, slo_tpot))
    raw_p = headroom * request_rate * sp
    raw_d = headroom * request_rate * sd
    p, d, limited_by = clamp_pair(replicas_for(raw_p), replicas_for(raw_d), bounds)
    return Plan(sp, sd, ratio, p, d, raw_p, raw_d, bool(limited_by), limited_by, inputs,
                colocation_advice(sp, sd, bounds.max_total or p + d, slo_tpot))


# --------------------------------------------------------------------------------------------------
# KV-cache budget

DTYPE_BYTES: dict[str, float] = {
    "fp32": 4, "float32": 4,
    "fp16": 2, "float16": 2, "half": 2,
    "bf16": 2, "bfloat16": 2,
    "fp8": 1, "int8": 1,
    "int4": 0.5,
}
QUANTIZED = {"int8", "int4", "fp8"}


@dataclass(frozen=True)
class KVBudget:
    bytes_per_token: int
    total_bytes: int
    scale_bytes_per_token: int
    total_bytes_with_scales: int
    inputs: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total_gb"] = self.total_bytes / 1e9
        d["total_gib"] = self.total_bytes / 2**30
        return d


def kv_budget(*, layers: int, kv_heads: int, head_dim: int, dtype: str, seq_len: int, batch: int) -> KVBudget:
    """K and V for every layer, KV head and head dim: 2 · layers · kv_heads · head_dim · bytes/element.

    pdcluster's int8/int4 caches also keep one float32 scale per (token, KV head) for K and for V; that
    overhead is reported separately (`scale_bytes_per_token`) and not included in `bytes_per_token`.
    """
    for name, v in (("layers", layers), ("kv-heads", kv_heads), ("head-dim", head_dim),
                    ("seq-len", seq_len), ("batch", batch)):
        if v is None or int(v) != v or v <= 0:
            raise PlanError(f"{name} must be a positive integer (got {v})")
    key = dtype.lower()
    if key not in DTYPE_BYTES:
        raise PlanError(f"unknown dtype {dtype!r} (choose from {', '.join(sorted(DTYPE_BYTES))})")
    if key == "int4" and head_dim % 2:
        raise PlanError("int4 needs an even head-dim (two values per byte)")
    per_token = int(2 * layers * kv_heads * head_dim * DTYPE_BYTES[key])
    scales = 2 * layers * kv_heads * 4 if key in ("int8", "int4") else 0
    tokens = seq_len * batch
    return KVBudget(
        bytes_per_token=per_token,
        total_bytes=per_token * tokens,
        scale_bytes_per_token=scales,
        total_bytes_with_scales=(per_token + scales) * tokens,
        inputs={"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "dtype": dtype,
                "seq_len": seq_len, "batch": batch},
    )
