"""`pdcluster` is never dominated on a small slice: no other policy of `simulate` is both within the SLO
more often and cheaper, primed or cold; and cold it is within a point of the reactive oracle.

A regression guard on one synthetic Mooncake-schema slice (`synth.py`: bursts, a level shift, 5 % of
prompts too long for the TTFT) and on the 40-minute `shift` trace (the load moves from prefill to decode),
run through the `simulate` CLI, `pdcluster` being the product's default (role flips on) and
`pdcluster-no-flips` one of the others. It does not hold on every slice: the tables in
docs/benchmarks/autoscaler.md say where it does not."""

from __future__ import annotations

import json

import pytest

from pdcluster.bench.sim import synth
from pdcluster.cli import main


@pytest.fixture(scope="module")
def slice_trace(tmp_path_factory):
    p = tmp_path_factory.mktemp("t") / "synth.jsonl"
    assert synth.main(["--out", str(p), "--seed", "3", "--minutes", "15", "--rate", "0.4"]) == 0
    return p


@pytest.mark.parametrize("cold", [False, True])
def test_pdcluster_is_not_dominated(tmp_path, slice_trace, cold):
    out = tmp_path / "o"
    assert main(["simulate", "--trace", str(slice_trace), "--out", str(out), "--no-plots",
                 *(["--cold"] if cold else [])]) == 0
    doc = json.loads((out / "summary.json").read_text())
    ps = doc["policies"]
    assert len(ps) >= 6 and doc["trace"]["infeasible_requests"]["count"] > 0
    me = ps["pdcluster"]
    for name, p in ps.items():
        assert not (p["slo_attainment"] > me["slo_attainment"] and p["instance_hours"] < me["instance_hours"]), name
    assert doc["goal"]["dominated_by"] == []
    if cold:
        assert doc["goal"]["points_below_reactive_oracle"] <= 1.0


@pytest.fixture(scope="module")
def shift_trace(tmp_path_factory):
    p = tmp_path_factory.mktemp("t") / "shift.jsonl"
    assert synth.main(["--out", str(p), "--shape", "shift", "--minutes", "40"]) == 0
    return p


@pytest.mark.parametrize("cold", [False, True])
def test_pdcluster_is_not_dominated_when_the_load_moves_from_prefill_to_decode(tmp_path, shift_trace, cold):
    # Primed, the measured pass meets 6k-token prompts with the one prefill instance the decode-heavy end
    # of the first pass left: before `backlog_clears` and `capacity_cut` the guard grew prefill 3 -> 7 -> 11
    # for a queue the 7 drained in 25 s, and `static-best` (3:3) and the oracle were better and cheaper.
    out = tmp_path / "o"
    assert main(["simulate", "--trace", str(shift_trace), "--out", str(out), "--no-plots",
                 *(["--cold"] if cold else [])]) == 0
    goal = json.loads((out / "summary.json").read_text())["goal"]
    assert goal["dominated_by"] == []  # pdcluster-no-flips included: flips are the product's default
    assert goal["cost_vs_static_best"] < 1.0
    if cold:
        # Not the 1 point: the oracle flips too and reads the turn of the mix within 10 s, where
        # the 120 s window still mixes both halves (docs/benchmarks/autoscaler.md, "Where it stands": 2.5)
        assert goal["points_below_reactive_oracle"] <= 3.0


@pytest.mark.parametrize(("seed", "extra"), [(2, ["--load-aggregation"]), (4, ["--cold"])])
def test_a_chance_peak_keeps_no_instance_a_fixed_size_does_without(tmp_path, seed, extra):
    # A steady 4 req/s shows 10 s peaks of 5-6 req/s by chance; read as variability they gave a 1.2x
    # headroom and a fourth prefill instance for 3 instances' load, through the whole first half. Then a
    # fixed size picked for the trace was cheaper and better: 2:3 with aggregation (seed 2, primed: 3.33
    # against 3.43 instance-h) and 3:2 (seed 4, cold: 3.33 against 3.39), and on seed 4 the oracle.
    p = tmp_path / "shift.jsonl"
    assert synth.main(["--out", str(p), "--shape", "shift", "--minutes", "40", "--seed", str(seed)]) == 0
    out = tmp_path / "o"
    assert main(["simulate", "--trace", str(p), "--out", str(out), "--no-plots", *extra]) == 0
    goal = json.loads((out / "summary.json").read_text())["goal"]
    assert goal["dominated_by"] == []


@pytest.mark.parametrize("seed", [3, 4])
def test_primed_shifts_are_not_dominated_by_the_oracle_with_flips_on_a_short_window(tmp_path, seed):
    # Primed, the measured pass starts decode-heavy and meets 6k-token prompts: the oracle flips decode
    # workers to prefill at its first 10 s decision, and `pdcluster` did at its first 30 s one, which left the
    # oracle better and cheaper (seeds 3 and 4). The flip window (spec.autoscaling.flipWindowSeconds, 20 s
    # every 10 s) flips at 10 s too; `--flip-window 0` is the run before it.
    p = tmp_path / "shift.jsonl"
    assert synth.main(["--out", str(p), "--shape", "shift", "--minutes", "40", "--seed", str(seed)]) == 0
    goals = {}
    for w in ("0", "20"):
        out = tmp_path / f"o{w}"
        assert main(["simulate", "--trace", str(p), "--out", str(out), "--no-plots", "--flip-window", w]) == 0
        goals[w] = json.loads((out / "summary.json").read_text())["goal"]
    assert "reactive-oracle" in goals["0"]["dominated_by"]
    assert goals["20"]["dominated_by"] == []
    assert goals["20"]["points_below_reactive_oracle"] < goals["0"]["points_below_reactive_oracle"]


def test_prefill_sized_for_the_prompt_tail_meets_more_of_a_heavy_tailed_slice(tmp_path):
    # 5 % of the slice's prompts are over 50k tokens, and prompts queue behind them at a load the mean-rate
    # formula calls enough (the guard waits for a mean queue they rarely build); rule 16
    # (operator/autoscaler_tail.py) grows prefill for that tail, a step explained by the cause "tail"
    trace, out = tmp_path / "t.jsonl", tmp_path / "o"
    assert synth.main(["--out", str(trace), "--seed", "3", "--minutes", "15", "--rate", "0.5"]) == 0
    assert main(["simulate", "--trace", str(trace), "--out", str(out), "--no-plots", "--cold",
                 "--policy", "pdcluster", "--policy", "pdcluster-no-tail"]) == 0
    ps = json.loads((out / "summary.json").read_text())["policies"]
    tail, no_tail = ps["pdcluster"], ps["pdcluster-no-tail"]
    assert tail["slo_attainment"] > no_tail["slo_attainment"] + 0.02
    assert tail["scaling_steps_by_cause"].get("prefill:tail", 0) >= 1
    assert "prefill:tail" not in no_tail["scaling_steps_by_cause"]
