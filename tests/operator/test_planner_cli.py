"""The P:D formula, budgets, the KV budget, and the `plan` / `kv-budget` CLIs on top of them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdcluster.cli import main
from pdcluster.operator.planner import Bounds, PlanError, fit_budget, kv_budget, plan

DESIGN = dict(input_len=2048, output_len=512, prefill_capacity=10000, decode_capacity=2000)


def test_design_worked_example() -> None:
    p = plan(**DESIGN, request_rate=40, headroom=1.5)
    assert p.prefill_seconds_per_request == pytest.approx(0.2048)
    assert p.decode_seconds_per_request == pytest.approx(0.256)
    assert p.ratio == pytest.approx(1.25)
    assert (p.prefill_replicas, p.decode_replicas) == (13, 16)
    assert p.raw_prefill == pytest.approx(12.288) and p.raw_decode == pytest.approx(15.36)
    assert p.limited is False


def test_zero_traffic_gives_the_minimums() -> None:
    p = plan(**DESIGN, request_rate=0)
    assert (p.prefill_replicas, p.decode_replicas) == (1, 1)
    assert p.limited and set(p.limited_by) == {"min-prefill", "min-decode"}
    p = plan(**DESIGN, request_rate=0, bounds=Bounds(min_prefill=2, min_decode=3))
    assert (p.prefill_replicas, p.decode_replicas) == (2, 3)


def test_exact_multiples_do_not_round_up_on_float_noise() -> None:
    # 1.5 * 10 * 1000 / 1500 = 10.000000000000002 in floats; still 10 instances
    p = plan(input_len=1000, output_len=100, prefill_capacity=1500, decode_capacity=100, request_rate=10)
    assert p.prefill_replicas == 10


def test_clamps_to_max_and_reports_limited() -> None:
    p = plan(**DESIGN, request_rate=40, bounds=Bounds(max_prefill=8, max_decode=20))
    assert (p.prefill_replicas, p.decode_replicas) == (8, 16)
    assert p.limited and p.limited_by == ["max-prefill"]


def test_total_budget_keeps_the_ratio() -> None:
    p = plan(**DESIGN, request_rate=40, bounds=Bounds(max_total=20))
    assert p.prefill_replicas + p.decode_replicas == 20
    assert p.decode_replicas / p.prefill_replicas == pytest.approx(16 / 13, rel=0.15)
    assert "max-total-replicas" in p.limited_by
    assert fit_budget(13, 16, 9) == (4, 5)
    assert fit_budget(1, 30, 10, 1, 1) == (1, 9)
    assert fit_budget(3, 3, 100) == (3, 3)


def test_ratio_only_without_rate() -> None:
    p = plan(**DESIGN)
    assert p.prefill_replicas is None and p.ratio == pytest.approx(1.25)


@pytest.mark.parametrize("kw", [
    dict(prefill_capacity=0), dict(decode_capacity=-5), dict(input_len=-1), dict(output_len=0),
    dict(input_len=float("nan")),
])
def test_invalid_inputs(kw) -> None:
    with pytest.raises(PlanError):
        plan(**{**DESIGN, **kw}, request_rate=1)


def test_invalid_bounds_and_rate() -> None:
    with pytest.raises(PlanError):
        plan(**DESIGN, request_rate=-1)
    with pytest.raises(PlanError):
        plan(**DESIGN, request_rate=1, headroom=0.5)
    with pytest.raises(PlanError):
        plan(**DESIGN, request_rate=1, bounds=Bounds(min_prefill=5, max_prefill=2))
    with pytest.raises(PlanError):
        plan(**DESIGN, request_rate=1, bounds=Bounds(min_prefill=3, min_decode=3, max_total=5))


def test_kv_budget_design_numbers() -> None:
    b = kv_budget(layers=80, kv_heads=64, head_dim=128, dtype="fp16", seq_len=2048, batch=16)
    assert b.bytes_per_token == 2_621_440
    assert b.total_bytes == 85_899_345_920
    assert round(b.total_bytes / 1e9, 1) == 85.9
    i8 = kv_budget(layers=80, kv_heads=8, head_dim=128, dtype="int8", seq_len=1, batch=1)
    assert i8.bytes_per_token == 163_840 and i8.scale_bytes_per_token == 2 * 80 * 8 * 4
    i4 = kv_budget(layers=80, kv_heads=8, head_dim=128, dtype="int4", seq_len=1, batch=1)
    assert i4.bytes_per_token == 81_920
    with pytest.raises(PlanError):
        kv_budget(layers=0, kv_heads=8, head_dim=128, dtype="fp16", seq_len=1, batch=1)
    with pytest.raises(PlanError):
        kv_budget(layers=1, kv_heads=8, head_dim=128, dtype="fp7", seq_len=1, batch=1)


# ---- CLIs ---------------------------------------------------------------------------------------

PLAN_ARGS = ["plan", "--input-len", "2048", "--output-len", "512", "--prefill-capacity", "10000",
             "--decode-capacity", "2000"]


def test_plan_cli_json(capsys) -> None:
    assert main([*PLAN_ARGS, "--request-rate", "40", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prefill_replicas"] == 13 and out["decode_replicas"] == 16
    assert out["ratio"] == pytest.approx(1.25)
    assert out["prefill_seconds_per_request"] == pytest.approx(0.2048)
    assert out["decode_seconds_per_request"] == pytest.approx(0.256)
    assert out["limited"] is False
    assert out["inputs"]["request_rate"] == 40 and out["inputs"]["headroom"] == 1.5


def test_plan_cli_text_and_limits(capsys) -> None:
    assert main([*PLAN_ARGS, "--request-rate", "40", "--max-decode", "10"]) == 0
    text = capsys.readouterr().out
    assert "0.2048" in text and "0.256" in text and "1.25" in text
    assert "13 prefill, 10 decode" in text and "max-decode" in text
    assert main([*PLAN_ARGS, "--request-rate", "40", "--max-decode", "10", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["limited"] is True


@pytest.mark.parametrize("bad", [["--prefill-capacity", "0"], ["--input-len", "-5"],
                                 ["--request-rate", "-1"], ["--min-prefill", "4", "--max-prefill", "2"]])
def test_plan_cli_errors_are_one_line(capsys, bad) -> None:
    args = list(PLAN_ARGS)
    for flag, val in zip(bad[::2], bad[1::2], strict=True):
        if flag in args:
            args[args.index(flag) + 1] = val
        else:
            args += [flag, val]
    try:
        rc = main(args)
    except SystemExit as e:  # a bad number is refused by the parser (usage + one error line)
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("pdcluster plan: error:")


def test_kv_budget_cli(capsys) -> None:
    args = ["kv-budget", "--layers", "80", "--kv-heads", "64", "--head-dim", "128", "--dtype", "fp16",
            "--seq-len", "2048", "--batch", "16"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_token"] == 2_621_440 and out["total_bytes"] == 85_899_345_920
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "2,621,440 B" in text and "85.9 GB" in text
    # int4 with an odd head dim passes the parser; the planner's rule is one error line
    assert main(["kv-budget", "--layers", "80", "--kv-heads", "8", "--head-dim", "127", "--dtype", "int4",
                 "--seq-len", "2048", "--batch", "16"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pdcluster kv-budget: error:") and "\n" not in err


def test_cli_entry_point_does_not_import_torch() -> None:
    code = ("import sys; from pdcluster.cli import main; "
            "rc = main(['plan','--input-len','1','--output-len','1','--prefill-capacity','1',"
            "'--decode-capacity','1','--json']); "
            "import pdcluster.operator.handlers, pdcluster.operator.cli; "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
