"""Role flips in the simulator: a worker drains, keeps its weights and serves the other role flip_s
later; `pdcluster` (flips on, the product's default) takes a short pool's growth from the other pool's
slack, `pdcluster-no-flips` starts pods for it."""

from __future__ import annotations

import json

from pdcluster.bench import trace as tr
from pdcluster.bench.sim import policies as pol
from pdcluster.bench.sim import synth
from pdcluster.bench.sim.cluster import simulate
from pdcluster.bench.sim.model import SLO, ServiceModel
from pdcluster.bench.sim.report import policy_summary
from pdcluster.bench.trace import Request, Trace

M = ServiceModel()


def shift_trace(minutes: float = 20.0) -> Trace:
    rows = synth.generate_shift(seed=2, minutes=minutes, rate=4.0)
    return tr.parse_trace("".join(json.dumps(r) + "\n" for r in rows), "shift")


def test_flips_serve_a_shift_from_prefill_to_decode_sooner_and_cheaper():
    # 20 minutes (the turn at 10): over 16, the decode guard (rules.queue_in_front) grows decode by a pod
    # before prefill's formula leaves it a worker to flip
    trace, slo = shift_trace(), SLO()
    runs = {}
    for name in ("pdcluster", "pdcluster-no-flips"):
        p = pol.make(name, M.prefill_tps, M.decode_tps, trace=trace, slo=slo)
        runs[name] = (simulate(trace, M, p), p)
    flipped, plain = runs["pdcluster"][0], runs["pdcluster-no-flips"][0]
    assert flipped.flips >= 1 and plain.flips == 0
    # flips by the decisions (RoleFlip) or by the short-window step between them (RoleFlipShortWindow)
    assert {"RoleFlip", "RoleFlipShortWindow"} & set(runs["pdcluster"][1].decisions)
    assert not {"RoleFlip", "RoleFlipShortWindow"} & set(runs["pdcluster-no-flips"][1].decisions)
    s_flip, s_plain = policy_summary(flipped, slo), policy_summary(plain, slo)
    assert s_flip["slo_attainment"] >= s_plain["slo_attainment"]
    assert s_flip["instance_hours"] <= s_plain["instance_hours"]
    assert s_flip["role_flips"] == flipped.flips
    # each pool size change is counted under its cause (operator/autoscaler_explain.py), flips as "flip"
    assert s_flip["scaling_steps_by_cause"].get("decode:flip", 0) >= 1
    assert all(k.split(":")[1] in ("formula", "burst", "tail", "slo-guard", "flip", "bound", "stabilization", "limit",
                                   "hold") for k in s_plain["scaling_steps_by_cause"])
    assert sum(s_plain["scaling_steps_by_cause"].values()) >= 1
    # nothing lost: every admitted request finished
    assert all(d is not None or rej for d, rej in zip(flipped.done, flipped.rejected, strict=True))


class FlipOnce:
    """One prefill worker flips to decode at the first decision (the rest of the policy is static)."""

    name = "flip-once"
    pending_flips = (0, 0)

    def __init__(self) -> None:
        self.n = 0

    def initial(self) -> tuple[int, int]:
        return 2, 1

    def decide(self, inp) -> tuple[int, int]:
        self.n += 1
        self.pending_flips = (0, 1) if self.n == 1 else (0, 0)
        return 1, 2


def test_a_flip_drains_first_then_serves_after_flip_s_without_a_pod_start():
    # both prefill workers hold a 100k-token prompt (10 s) when the flip is asked at 30 s: the one that
    # flips finishes its prompt first, then serves decode flip_s later
    reqs = (Request(25.0, 100_000, 5), Request(26.0, 100_000, 5), *(Request(40.0 + i, 500, 50) for i in range(30)))
    trace = Trace(reqs, "azure", "t")
    model = ServiceModel(pod_start_s=600.0, flip_s=5.0)
    r = simulate(trace, model, FlipOnce())
    assert r.flips == 1
    ready = {t: (pr, dr) for t, _, _, pr, dr, _ in r.timeline}
    assert ready[30.0] == (1, 1)  # draining: no new prompts, not yet decode
    assert ready[60.0] == (1, 2)  # drained by ~36 s, decode from ~41 s: no pod start (600 s)
    assert all(d is not None for d in r.done)


def test_the_flip_window_reads_a_turn_of_the_mix_sooner_and_starts_no_pod():
    # Primed on the 40-minute shift: the measured pass starts decode-heavy (1 prefill, 3 decode) and meets
    # 6k-token prompts; the flip step (20 s window, every 10 s) moves decode workers to prefill at 10 s, where
    # the decisions' first tick is at 30 s (docs/benchmarks/autoscaler.md, shift seed 3: 94.72 % -> 96.86 %,
    # 3.22 -> 3.01 instance-h)
    rows = synth.generate_shift(seed=3, minutes=40, rate=4.0)
    trace, slo = tr.parse_trace("".join(json.dumps(r) + "\n" for r in rows), "shift"), SLO()
    out = {}
    for w in (0.0, 20.0):
        p = pol.make("pdcluster", M.prefill_tps, M.decode_tps, trace=trace, slo=slo, flip_window_s=w)
        first = simulate(trace, M, p)
        p = pol.carry_over(p, trace.duration_s, (first.timeline[-1][1], first.timeline[-1][2]))
        out[w] = (policy_summary(simulate(trace, M, p), slo), p)
    off, on = out[0.0][0], out[20.0][0]
    assert "RoleFlipShortWindow" in out[20.0][1].decisions and "RoleFlipShortWindow" not in out[0.0][1].decisions
    assert on["slo_attainment"] > off["slo_attainment"] and on["instance_hours"] <= off["instance_hours"] + 1e-9
