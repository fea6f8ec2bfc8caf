"""The ratio sweep's pure parts: splits of a worker budget, the formula's split, goodput and the verdict;
and the autoscale replay's attribution of failures to scale-downs."""

from __future__ import annotations

import pytest

from benchmarks import ratio_plan as rp
from benchmarks.autoscale_replay import arrivals_per_bin, failed_during_scale_down, stop_events
from pdcluster.bench.trace import Request, Trace


def test_splits_of_a_budget_with_and_without_colocated():
    assert rp.splits(4) == [(0, 4), (1, 3), (2, 2), (3, 1)]
    assert rp.splits(4, colocated=False) == [(1, 3), (2, 2), (3, 1)]
    with pytest.raises(ValueError):
        rp.splits(1)


def test_formula_split_follows_the_per_request_seconds():
    # DESIGN.md's example: 2048 in / 512 out, 10k and 2k tok/s: 0.2048 s vs 0.256 s -> D/P 1.25 -> 2:2 of 4
    f = rp.formula_split(4, 2048, 512, 10_000, 2_000)
    assert (f.prefill, f.decode) == (2, 2)
    assert f.ratio == pytest.approx(1.25)
    assert f.ideal_prefill == pytest.approx(4 * 0.2048 / (0.2048 + 0.256))
    # prefill-heavy (the scaled Azure code trace): D/P ~ 0.05 -> as much prefill as the budget allows, and a
    # decode pool so small (0.2 of an instance) that the planner's answer for the budget is to colocate
    f = rp.formula_split(4, 535, 7.3, 2570, 641)
    assert f.disaggregated == (3, 1) and (f.prefill, f.decode) == (0, 4) and f.rule == "small-decode"
    # decode-heavy: the other end
    assert rp.formula_split(4, 100, 1000, 10_000, 500).prefill == 1
    f = rp.formula_split(6, 1000, 200, 1000, 400)  # 1 s vs 0.5 s per request: 2:1 -> 4:2 of 6
    assert (f.prefill, f.decode) == (4, 2)


def test_formula_split_counts_the_decode_join_seconds():
    # The last sweep's slice: I 302, O 2.8, C_p 481, C_d 211 -> O/C_d 13 ms, 3:1, and colocation advised.
    f0 = rp.formula_split(4, 302, 2.8, 481, 211)
    assert f0.disaggregated == (3, 1) and f0.decode_join_seconds == 0.0 and f0.colocate
    assert (f0.prefill, f0.decode) == (0, 4)  # the planner's answer for the budget: colocated
    # With t_join 0.2 s per request decode is ~25 % of the work: still 3:1 of 4, no longer "colocate".
    f = rp.formula_split(4, 302, 2.8, 481, 211, decode_join_seconds=0.2)
    assert f.decode_seconds == pytest.approx(2.8 / 211 + 0.2)
    assert f.ideal_prefill == pytest.approx(4 * (302 / 481) / (302 / 481 + 2.8 / 211 + 0.2))
    assert (f.prefill, f.decode) == (3, 1) == f.disaggregated and not f.colocate
    # Large enough, it moves the split: 0.6 s of joining per request -> D/P ~ 1 -> 2:2.
    assert (rp.formula_split(4, 302, 2.8, 481, 211, decode_join_seconds=0.6).prefill) == 2
    with pytest.raises(ValueError, match="decode-join-seconds"):
        rp.formula_split(4, 302, 2.8, 481, 211, decode_join_seconds=-0.1)


def test_sweep_slice_keeps_outputs_with_max_output_tokens(tmp_path):
    from benchmarks.ratio_sweep import load_slice

    rows = "\n".join(f'{{"timestamp": {i * 1000}, "input_length": {2000 * (i + 1)}, "output_length": {30 + i}}}'
                     for i in range(4))
    (tmp_path / "t.jsonl").write_text(rows + "\n")
    kept = load_slice(tmp_path / "t.jsonl", 0, 10, 1024, max_output_tokens=32)
    assert [r.output_tokens for r in kept.requests] == [30, 31, 32, 32]
    crushed = load_slice(tmp_path / "t.jsonl", 0, 10, 1024)
    assert max(r.output_tokens for r in crushed.requests) < 10


def test_goodput_counts_only_successes_within_both_objectives():
    recs = [
        {"ok": True, "ttft": 0.5, "tpot": 0.05},   # good
        {"ok": True, "ttft": 0.5, "tpot": None},   # one token: no TPOT, good
        {"ok": True, "ttft": 3.0, "tpot": 0.05},   # TTFT too late
        {"ok": True, "ttft": 0.5, "tpot": 0.5},    # TPOT too slow
        {"ok": False, "ttft": None, "tpot": None, "error": "http_503"},
    ]
    g = rp.goodput(recs, 2.0, 0.1, 10.0)
    assert g == {"requests": 5, "ok": 4, "failed": 1, "within_slo": 2, "attainment": 0.4, "goodput_rps": 0.2}
    with pytest.raises(ValueError):
        rp.goodput(recs, 2.0, 0.1, 0.0)


def test_verdict_compares_the_formula_mean_with_the_best_mean():
    runs = [((1, 3), 2.0), ((1, 3), 2.2), ((3, 1), 3.0), ((3, 1), 2.6), ((2, 2), 2.9), ((2, 2), 2.9)]
    v = rp.verdict(runs, (3, 1))
    assert v.best == (2, 2) and v.mean_goodput[(3, 1)] == pytest.approx(2.8)
    assert v.formula_share_of_best == pytest.approx(2.8 / 2.9) and v.met
    miss = rp.verdict(runs, (1, 3))
    assert not miss.met and miss.formula_share_of_best == pytest.approx(2.1 / 2.9)
    with pytest.raises(ValueError):
        rp.verdict(runs, (0, 4))


def test_failures_are_attributed_to_a_scale_down_only_when_in_flight_near_it():
    events = [{"t": 100.0, "line": "autoscale: started prefill-1"}, {"t": 200.0, "line": "autoscale: stopped decode-1"}]
    stops = stop_events(events)
    assert stops == [200.0]
    recs = [
        {"ok": False, "start": 195.0, "latency": 1.0},   # in flight 10 s before the stop: counted
        {"ok": False, "start": 10.0, "latency": 2.0},    # long before: an overload failure, not the scale-down's
        {"ok": True, "start": 199.0, "latency": 3.0},    # survived the stop
    ]
    assert failed_during_scale_down(recs, stops) == [recs[0]]
    assert failed_during_scale_down(recs, []) == []


def test_arrivals_per_bin():
    t = Trace(tuple(Request(x, 10, 1) for x in (0.0, 1.0, 5.5, 12.0)), "azure", "x")
    assert arrivals_per_bin(t, 5.0) == [2, 1, 1]


def test_markdown_table_marks_the_formula_and_averages_rounds():
    from benchmarks.ratio_sweep import markdown_table

    run = lambda p, d, g: {"prefill": p, "decode": d, "goodput_rps": g, "attainment": g / 2,  # noqa: E731
                           "ttft_p50_s": 1.0, "tpot_p50_s": 0.1, "tpot_p99_s": 0.3, "load1_before": 3.0}
    limited = {"throttled": {"router": 0.9, "prefill-1": 0.25, "decode-2": 0.05}}  # the router is not a worker
    summary = {"splits": [(0, 2), (1, 1)], "formula": {"prefill": 1, "decode": 1},
               "runs": [run(0, 2, 1.0), {**run(1, 1, 1.5), "decode_step_seconds_live": 0.021, **limited},
                        run(1, 1, 0.5)]}
    rows = markdown_table(summary).splitlines()
    assert rows[2].endswith("| 0.10 / 0.30 | – | – | 3 |")
    assert rows[3].endswith("| 21 | 25 % | 3 / 3 |")  # live step and throttling where measured
    assert rows[2].startswith("| 0:2 colocated | 1.00 | 1.00 | 50 %")
    assert rows[3].startswith("| 1:1 **(formula)** | 1.50 / 0.50 | 1.00 | 50 %")


def test_in_flight_before_a_stop_counts_requests_overlapping_the_drain_window():
    from benchmarks.autoscale_replay import in_flight_before

    recs = [{"start": 90.0, "latency": 5.0}, {"start": 80.0, "latency": 30.0}, {"start": 101.0, "latency": 1.0},
            {"start": 50.0, "latency": 10.0}]
    assert in_flight_before(recs, 100.0) == 2  # ended at 95 (in the window) and still running; not later/earlier


def test_a_run_whose_stack_did_not_start_is_tried_once_more(monkeypatch):
    from benchmarks import local_stack
    from benchmarks import ratio_sweep as rs

    calls = []

    def one_try(*a):
        calls.append(a)
        if len(calls) == 1 or fail_again:
            raise local_stack.StartError("not ready")
        return {"goodput_rps": 1.0}

    monkeypatch.setattr(rs, "one_try", one_try)
    monkeypatch.setattr(rs.time, "sleep", lambda s: None)
    fail_again = False
    assert rs.one_run(None, (1, 3), 0, 1, 60.0) == {"goodput_rps": 1.0, "start_retried": True}
    fail_again, calls[:] = True, []
    with pytest.raises(local_stack.StartError):  # twice: the sweep stops (and says why)
        rs.one_run(None, (1, 3), 0, 1, 60.0)
    assert len(calls) == 2


def test_summary_is_written_after_every_run_and_plots_the_splits_measured(tmp_path):
    from benchmarks import ratio_sweep as rs

    # TPOT objective 0.1 s: a prefill (0.23 s) does not fit in it, so the formula's answer is disaggregated
    args = rs.parse_args(["--trace", "t.csv", "--out", str(tmp_path), "--workers", "4", "--slo-tpot", "0.1"])
    sl = {"mean_input_tokens": 228.0, "mean_output_tokens": 20.2}
    cap = {"prefill_tokens_per_second": 995.5, "decode_tokens_per_second": 190.7, "decode_join_seconds": 0.022}
    run = lambda p, d, g, rnd=0: {"round": rnd, "prefill": p, "decode": d, "goodput_rps": g}  # noqa: E731
    todo = [(0, 4), (1, 3), (2, 2), (3, 1)]
    first = rs.write_summary(args, sl, 60.0, todo, cap, [run(0, 4, 1.0)], complete=False)
    assert (first["formula"]["prefill"], first["formula"]["decode"]) == (3, 1)  # ideal P 2.57 of 4
    assert "verdict" not in first and not (tmp_path / "goodput.png").exists()  # 3:1 not run yet
    runs = [run(0, 4, 1.0), run(1, 3, 0.8), run(3, 1, 0.5), run(3, 1, 0.7, 1)]
    s = rs.write_summary(args, sl, 60.0, todo, cap, runs, complete=False)
    assert s["verdict"]["formula_share_of_best"] == pytest.approx(0.6) and not s["verdict"]["met"]
    assert (tmp_path / "goodput.png").stat().st_size > 0  # 2:2 unmeasured: left out of the plot, no error
    import json

    assert json.loads((tmp_path / "summary.json").read_text())["complete"] is False
    # the sweep's default 0.5 s objective: the prefill fits, the formula's answer is colocated, judged as such,
    # and its nearest disaggregated split is judged among the disaggregated ones
    args = rs.parse_args(["--trace", "t.csv", "--out", str(tmp_path), "--workers", "4"])
    s = rs.write_summary(args, sl, 60.0, todo, cap, runs, complete=True)
    assert (s["formula"]["prefill"], s["formula"]["rule"]) == (0, "prefill-within-tpot")
    assert s["verdict"]["formula_share_of_best"] == 1.0 and s["verdict"]["met"]
    assert s["verdict"]["disaggregated_share_of_best_disaggregated"] == pytest.approx(0.6 / 0.8)


def test_cores_received_is_cpu_seconds_over_wall_time():
    from benchmarks.ratio_sweep import cores_received

    got = cores_received({"decode-2": 10.0, "router": 1.0}, {"decode-2": 16.0, "router": 2.0, "prefill-1": 3.0}, 60.0)
    assert got == pytest.approx({"decode-2": 0.1, "prefill-1": 0.05, "router": 1 / 60})
    assert cores_received({}, {"x": 1.0}, 0.0) == {}


def test_formula_split_is_colocated_when_a_prefill_fits_within_the_tpot_objective():
    """The quiet 6x sweep (docs/benchmarks/ratio_sweep.md at 5f904a5 §00): I 228, O 20, C_p 2427, C_d 1152, t_join 5 ms.
    Without an objective the formula said 3:1 (colocated won, 3:1 reached 40 % of it); a prefill of 0.094 s
    fits within the 0.5 s TPOT objective, so the planner's answer for the budget is colocated."""
    f = rp.formula_split(4, 228, 20, 2427, 1152, 0.005)
    assert (f.prefill, f.decode) == (3, 1) and not f.colocate
    f = rp.formula_split(4, 228, 20, 2427, 1152, 0.005, slo_tpot=0.5)
    assert (f.prefill, f.decode) == (0, 4) and f.rule == "prefill-within-tpot" and f.disaggregated == (3, 1)
    # a tight objective (or long prompts) leaves decode something to protect: disaggregate
    assert (rp.formula_split(4, 228, 20, 2427, 1152, 0.005, slo_tpot=0.05).prefill) == 3


def test_the_sweep_load_is_the_highest_scanned_rate_the_best_split_still_mostly_meets():
    scan = [(4.0, 0.35), (2.0, 0.93), (3.0, 0.82), (1.0, 1.0)]
    assert rp.pick_speedup(scan) == 3.0  # 4x: most requests miss it -> collapse, not capacity
    assert rp.pick_speedup(scan, min_attainment=0.9) == 2.0
    assert rp.pick_speedup([(2.0, 0.3), (3.0, 0.1)]) == 2.0  # none qualifies: the lowest scanned
    with pytest.raises(ValueError):
        rp.pick_speedup([])


def test_share_of_best_among_a_subset():
    mean = {(0, 4): 10.0, (1, 3): 6.0, (2, 2): 8.0, (3, 1): 4.0}
    assert rp.share_of_best(mean, (3, 1)) == pytest.approx(0.4)
    assert rp.share_of_best(mean, (3, 1), [(1, 3), (2, 2), (3, 1)]) == pytest.approx(0.5)
    assert rp.share_of_best(mean, (9, 9)) is None


def test_the_rate_scan_runs_the_scan_split_once_per_speedup_and_picks_the_load(monkeypatch, tmp_path):
    from benchmarks import ratio_sweep as rs

    seen = []
    attained = {2.0: 0.97, 3.0: 0.85, 4.0: 0.4}

    def fake(args, split, rnd, port, span):
        seen.append((split, args.speedup, span))
        return {"attainment": attained[args.speedup], "goodput_rps": 1.0, "ttft_p50_s": 1.0, "tpot_p50_s": 0.1,
                "uptime_before": "x"}

    monkeypatch.setattr(rs, "one_run", fake)
    args = rs.parse_args(["--trace", "t.csv", "--out", str(tmp_path), "--duration", "60", "--scan-speedups", "4,2,3"])
    speed, rows = rs.scan(args)
    assert speed == 3.0 and [r["speedup"] for r in rows] == [2.0, 3.0, 4.0]
    assert seen == [((0, 4), 2.0, 30.0), ((0, 4), 3.0, 20.0), ((0, 4), 4.0, 15.0)]
