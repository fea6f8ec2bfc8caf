"""The held-out sweep (`bench/sim/sweep.py`) and the Azure-shaped synthetic trace it runs (`synth.py`'s
`bursty`): the shape matches the trace it was fitted to, the verdicts count what the docstring says, and a
small sweep writes its files."""

from __future__ import annotations

import json
import statistics

import pytest

from pdcluster.bench.sim import sweep, synth


def test_bursty_shape_fits_the_azure_code_trace():
    rows = synth.generate_bursty(seed=4, minutes=60.0, rate=2.5)
    assert rows == synth.generate_bursty(seed=4, minutes=60.0, rate=2.5)  # a seed is a trace
    times = [r["timestamp"] / 1000 for r in rows]
    assert times == sorted(times) and times[-1] < 3600
    bins = [0] * 360
    for t in times:
        bins[int(t // 10)] += 1
    silent = sum(1 for b in bins if b == 0) / len(bins)
    assert 0.35 < silent < 0.75  # Azure: 56 % of its 10 s steps are empty
    assert 1.5 < len(rows) / 3600 < 3.5
    prompts = [r["input_length"] for r in rows]
    assert abs(statistics.mean(prompts) - synth.AZURE_PROMPT_MEAN) < 0.1 * synth.AZURE_PROMPT_MEAN
    assert max(prompts) <= synth.AZURE_PROMPT_MAX and min(prompts) >= 1
    outputs = sorted(r["output_length"] for r in rows)
    assert 9 <= outputs[len(outputs) // 2] <= 17 and 20 < statistics.mean(outputs) < 36
    assert "hash_ids" not in rows[0]  # the Azure trace records no prefixes


def test_synth_cli_writes_a_bursty_trace(tmp_path):
    out = tmp_path / "b.jsonl"
    assert synth.main(["--shape", "bursty", "--seed", "2", "--minutes", "5", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) > 0


def test_seed_ranges():
    assert sweep.seeds("101-103") == [101, 102, 103]
    assert sweep.seeds("3,5,13-14") == [3, 5, 13, 14]
    for bad in ("5-3", "x", "1-"):
        with pytest.raises(ValueError):
            sweep.seeds(bad)


def _line(mode: str, **policies: tuple[float, float]) -> dict:
    return {"shape": "bursty", "seed": 1, "mode": mode, "aggregation": False,
            "policies": {n.replace("_", "-"): {"slo_attainment": a, "instance_hours": h}
                         for n, (a, h) in policies.items()}}


def test_verdict_keeps_the_oracle_apart():
    cold = _line("cold", pdcluster=(0.90, 5.0), reactive_oracle=(0.95, 4.0), keda_tokens=(0.91, 4.5),
                 static_best=(0.99, 6.0))
    v = sweep.verdict(cold)
    assert v["dominated_by"] == ["keda-tokens"] and v["by_oracle"]
    assert v["vs_oracle"] == pytest.approx(-5.0)
    primed = _line("primed", pdcluster=(0.99, 7.2), reactive_oracle=(0.93, 4.0), static_best=(0.995, 6.0))
    v = sweep.verdict(primed)
    assert v["dominated_by"] == ["static-best"] and not v["by_oracle"]  # more within SLO for less
    assert v["vs_static_best"] == pytest.approx(-0.5) and v["cost_ratio"] == pytest.approx(1.2)
    text = sweep.summary([cold, primed])
    assert "| bursty | 2 | 2 | 1 | -5.00, -5.00 (0/1) | -0.50, -0.50 (1/1) |" in text
    assert "bursty seed 1 cold: dominated by keda-tokens" in text


def test_a_small_sweep_writes_its_files(tmp_path, capsys):
    assert sweep.main(["--out", str(tmp_path), "--shapes", "bursty", "--seeds", "1", "--minutes", "6",
                       "--jobs", "1"]) == 0
    lines = [json.loads(x) for x in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [x["mode"] for x in lines] == ["primed", "cold"]
    assert {"pdcluster", "reactive-oracle", "static-best", "keda-tokens"} <= lines[0]["policies"].keys()
    assert "| bursty | 2 |" in (tmp_path / "summary.md").read_text()
    assert "| bursty | 2 |" in capsys.readouterr().out


def test_bad_arguments_exit_2(tmp_path):
    for argv in (["--seeds", "9-1"], ["--jobs", "0"], ["--minutes", "0"], ["--shapes", "nope"]):
        with pytest.raises(SystemExit) as e:
            sweep.main(["--out", str(tmp_path), *argv])
        assert e.value.code == 2


def test_prime_other_primes_on_another_seed(tmp_path):
    assert sweep.main(["--out", str(tmp_path), "--shapes", "bursty", "--seeds", "2", "--minutes", "6",
                       "--jobs", "1", "--prime", "other"]) == 0
    lines = [json.loads(x) for x in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [(x["mode"], x["primed_on"]) for x in lines] == [("primed", 2 + sweep.PRIME_OFFSET), ("cold", None)]
    assert (tmp_path / f"bursty-{2 + sweep.PRIME_OFFSET}-6min.jsonl").exists()  # a length is part of the name


def test_every_policy_is_asked_the_same_question():
    cold = _line("cold", pdcluster=(0.90, 5.0), reactive_oracle=(0.95, 4.0), keda_tokens=(0.91, 4.5),
                 static_best=(0.99, 6.0))
    primed = _line("primed", pdcluster=(0.99, 7.2), reactive_oracle=(0.93, 4.0), static_best=(0.995, 6.0))
    rows = sweep.every_policy([cold, primed])
    assert "| pdcluster | 2 | 2 | 2 | keda-tokens 1, reactive-oracle 1, static-best 1 |" in rows  # count, then name
    assert "| keda-tokens | 1 | 1 | 0 | reactive-oracle 1 |" in rows  # only the oracle: none a cluster can run
    assert "| reactive-oracle | 2 | 0 | 0 | – |" in rows
    assert "| static-best | 2 | 0 | 0 | – |" in rows


def test_summarize_rewrites_the_summary_from_the_runs(tmp_path, capsys):
    lines = [_line("cold", pdcluster=(0.90, 5.0), reactive_oracle=(0.95, 4.0), static_best=(0.99, 6.0))]
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert sweep.main(["--out", str(tmp_path), "--summarize"]) == 0
    text = (tmp_path / "summary.md").read_text()
    assert text == sweep.summary(lines) + "\n" and "| reactive-oracle | 1 | 0 | 0 | – |" in text
    assert not list(tmp_path.glob("bursty-*.jsonl"))  # nothing was run
    with pytest.raises(SystemExit) as e:  # no runs to summarize: a usage error, not a traceback
        sweep.main(["--out", str(tmp_path / "none"), "--summarize"])
    assert e.value.code == 2
    assert "runs.jsonl" in capsys.readouterr().err
    for bad in ("{not json\n", "[1, 2]\n", '{"shape": "bursty"}\n'):  # not JSON, or not a sweep's lines
        (tmp_path / "runs.jsonl").write_text(bad)
        with pytest.raises(SystemExit) as e:
            sweep.main(["--out", str(tmp_path), "--summarize"])
        assert e.value.code == 2
