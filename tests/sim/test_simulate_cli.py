"""`pdcluster simulate`: the summary.json contract, the PNGs, and one-line errors with exit 2."""

from __future__ import annotations

import json
import random

import pytest

from pdcluster.cli import main

POLICY_KEYS = {"slo_attainment", "ttft_p99_s", "tpot_p99_s", "instance_hours", "prefill_instance_hours",
               "decode_instance_hours", "scale_events", "max_prefill", "max_decode"}


@pytest.fixture
def small_trace(tmp_path):
    rng = random.Random(1)
    lines, t = [], 0.0
    for _ in range(600):
        t += rng.expovariate(2.0 if t < 150 or t > 300 else 8.0)
        lines.append(json.dumps({"timestamp": int(t * 1000), "input_length": rng.randint(500, 4000),
                                 "output_length": rng.randint(1, 300), "hash_ids": [0, rng.randint(1, 9)]}))
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_summary_schema_and_plots(tmp_path, small_trace, capsys):
    out = tmp_path / "out"
    assert main(["simulate", "--trace", str(small_trace), "--out", str(out), "--slo-ttft", "3"]) == 0
    doc = json.loads((out / "summary.json").read_text())
    assert set(doc["trace"]) >= {"requests", "duration_s", "mean_input_tokens", "mean_output_tokens"}
    assert doc["trace"]["requests"] == 600
    # the trace has hash_ids (prefix reuse): the default set adds the pdcluster policy without the discount
    assert set(doc["policies"]) == {"pdcluster", "pdcluster-no-flips", "pdcluster-no-prefix", "reactive-oracle",
                                    "no-headroom", "independent", "keda-tokens", "static-1:1", "static-best"}
    # prompts of at most 4000 tokens take 0.4 s of prefill: none is infeasible at a 3 s TTFT
    inf = doc["trace"]["infeasible_requests"]
    assert inf["count"] == 0 and inf["why"] == {"prefill_exceeds_ttft": 0, "decode_step_exceeds_tpot": 0}
    assert all(p["slo_attainment_feasible"] == p["slo_attainment"] for p in doc["policies"].values())
    assert isinstance(doc["goal"]["dominated_by"], list)
    assert doc["setup"]["primed"] is True and doc["policies"]["pdcluster"]["prefix_hit_rate"] > 0
    for name, p in doc["policies"].items():
        assert POLICY_KEYS <= set(p), name
        assert 0.0 <= p["slo_attainment"] <= 1.0
        assert isinstance(p["scale_events"], int) and isinstance(p["max_prefill"], int)
    for name in ("static-1:1", "static-best"):
        assert doc["policies"][name]["scale_events"] == 0
    best = doc["policies"]["static-best"]
    assert best["slo_attainment"] >= min(0.99, max(p["slo_attainment"] for p in doc["policies"].values())) - 1e-9
    assert (out / "replicas.png").stat().st_size > 1000 and (out / "tradeoff.png").stat().st_size > 1000
    assert "pdcluster" in capsys.readouterr().out


def test_policy_subset_and_speedup(tmp_path, small_trace):
    out = tmp_path / "o"
    assert main(["simulate", "--trace", str(small_trace), "--out", str(out), "--policy", "static-1:1",
                 "--policy", "static-2:1", "--speedup", "2", "--no-plots"]) == 0
    doc = json.loads((out / "summary.json").read_text())
    assert list(doc["policies"]) == ["static-1:1", "static-2:1"]
    assert doc["trace"]["duration_s"] < 250  # ~450 s of trace at 2x
    assert not (out / "replicas.png").exists()


def test_decisions_log_one_row_per_tick_of_the_measured_pass(tmp_path, small_trace):
    import csv

    from pdcluster.bench.sim.decisions import COLUMNS

    out = tmp_path / "o"
    assert main(["simulate", "--trace", str(small_trace), "--out", str(out), "--no-plots", "--decisions",
                 "--policy", "pdcluster", "reactive-oracle", "static-1:1"]) == 0
    doc = json.loads((out / "summary.json").read_text())
    with (out / "decisions-pdcluster.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == COLUMNS
    # every 30 s tick of the trace (the primed first pass is not logged), in time order
    assert len(rows) == int(doc["trace"]["duration_s"] // 30)
    assert [float(r["t"]) for r in rows] == [30.0 * (k + 1) for k in range(len(rows))]
    sizes = [(int(r["prefill_desired"]), int(r["decode_desired"])) for r in rows]
    assert max(p for p, _ in sizes) == doc["policies"]["pdcluster"]["max_prefill"]
    # what holds a pool against scale-down is logged beside the needs: never below the need of a tick that
    # decided (a pool waiting for its rollout keeps the window it had)
    for r in rows:
        if r["prefillNeed"] and r["prefill_held_need"] and r["prefill_reason"] != "RolloutInProgress":
            assert float(r["prefill_held_need"]) >= float(r["prefillNeed"]) - 1e-3
    with (out / "decisions-reactive-oracle.csv").open() as f:
        assert len(list(csv.DictReader(f))) == int(doc["trace"]["duration_s"] // 10)  # the oracle's 10 s ticks
    assert not (out / "decisions-static-1:1.csv").exists()  # a fixed size decides nothing


def test_cold_start_and_headroom_are_recorded(tmp_path, small_trace):
    out = tmp_path / "c"
    assert main(["simulate", "--trace", str(small_trace), "--out", str(out), "--policy", "pdcluster",
                 "--cold", "--headroom", "1.2", "--no-prefix-cache", "--no-plots"]) == 0
    doc = json.loads((out / "summary.json").read_text())
    assert doc["setup"]["primed"] is False and doc["setup"]["headroom"] == 1.2
    assert doc["setup"]["prefix_cache_tokens"] == 0 and doc["policies"]["pdcluster"]["prefix_hit_rate"] == 0


@pytest.mark.parametrize("argv, needle", [
    (["--trace", "/nonexistent/x.csv"], "no such file"),
    (["--trace", "{wrong}", "--policy", "hpa"], "unknown policy"),
    (["--trace", "{wrong}"], "lacks 'TIMESTAMP'"),
    # numbers are checked at parse time (pdcluster.worker.api.cli_args), as every subcommand's are
    (["--trace", "{trace}", "--speedup", "0"], "argument --speedup: '0' must be > 0"),
    (["--trace", "{trace}", "--speedup", "fast"], "argument --speedup: 'fast' is not a number"),
    (["--trace", "{trace}", "--prefill-capacity", "-5"], "argument --prefill-capacity: '-5' must be > 0"),
    (["--trace", "{trace}", "--slo-ttft", "0"], "argument --slo-ttft: '0' must be > 0"),
    (["--trace", "{trace}", "--headroom", "0.5"], "argument --headroom: '0.5' must be in [1, 10]"),
    (["--trace", "{trace}", "--bogus"], "unrecognized arguments"),
    (["--trace", "{trace}", "--profile", "/nonexistent.json"], "no such profile"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, small_trace, capsys, argv, needle):
    wrong = tmp_path / "wrong.csv"
    wrong.write_text("a,b,c\n1,2,3\n")
    argv = [a.replace("{wrong}", str(wrong)).replace("{trace}", str(small_trace)) for a in argv]
    try:
        rc = main(["simulate", "--out", str(tmp_path / "o"), *argv])
    except SystemExit as e:  # argparse errors exit from inside parse_args
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err
