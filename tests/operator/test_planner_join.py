"""The planner's per-request decode cost (t_join: KV import, scheduling and first step of a transferred
request, which O/C_d leaves out) and its colocation advice; `pdcluster plan --decode-join-seconds`."""

from __future__ import annotations

import json
import math

import pytest

from pdcluster.cli import main
from pdcluster.operator.planner import COLOCATE_BELOW_DECODE, Bounds, PlanError, colocation_advice, plan

# The last ratio sweep's slice (docs/benchmarks/ratio_sweep.md at 5f904a5): I 302, O 2.8, C_p 481, C_d 211.
SWEEP = {"input_len": 302, "output_len": 2.8, "prefill_capacity": 481, "decode_capacity": 211}


def test_zero_join_is_todays_formula() -> None:
    a, b = plan(**SWEEP, request_rate=2.0), plan(**SWEEP, request_rate=2.0, decode_join_seconds=0.0)
    assert a.decode_seconds_per_request == pytest.approx(2.8 / 211)
    assert (a.prefill_replicas, a.decode_replicas, a.ratio) == (b.prefill_replicas, b.decode_replicas, b.ratio)
    assert a.inputs["decode_join_seconds"] == 0.0


def test_join_seconds_add_to_decode_per_request_and_grow_the_decode_pool() -> None:
    p = plan(**SWEEP, request_rate=6.0, headroom=1.0, decode_join_seconds=0.05)
    assert p.decode_seconds_per_request == pytest.approx(2.8 / 211 + 0.05)
    assert p.prefill_seconds_per_request == pytest.approx(302 / 481)  # prefill untouched
    assert p.raw_decode == pytest.approx(6.0 * (2.8 / 211 + 0.05))  # 0.38 instance, was 0.08
    assert p.ratio == pytest.approx((2.8 / 211 + 0.05) / (302 / 481))
    # at 30 req/s: 0.4 decode instances without it, 1.9 with it -> 2 decode replicas instead of 1
    assert plan(**SWEEP, request_rate=30.0, headroom=1.0).decode_replicas == 1
    assert plan(**SWEEP, request_rate=30.0, headroom=1.0, decode_join_seconds=0.05).decode_replicas == 2


@pytest.mark.parametrize("bad", [-0.01, math.nan, math.inf])
def test_bad_join_seconds_are_refused(bad: float) -> None:
    with pytest.raises(PlanError, match="decode-join-seconds"):
        plan(**SWEEP, decode_join_seconds=bad)


def test_colocation_advice_says_colocate_when_the_ideal_decode_pool_is_tiny() -> None:
    # The last sweep: decode ~2 % of the work; of 4 workers the ideal decode pool is 0.08 instances.
    a = colocation_advice(302 / 481, 2.8 / 211, 4)
    assert a["colocate"] is True and a["ideal_decode"] == pytest.approx(4 * 0.0207, rel=0.02)
    assert "colocate" in a["message"] and "--prefill 0" in a["message"]
    # balanced work: disaggregate
    b = colocation_advice(0.2048, 0.256, 4)
    assert b["colocate"] is False and b["ideal_decode"] == pytest.approx(4 * 0.256 / 0.4608)
    # the boundary: exactly COLOCATE_BELOW_DECODE of an instance is enough to disaggregate
    assert colocation_advice(3.5, 0.5, 4)["colocate"] is False
    assert colocation_advice(3.6, 0.4, 4)["colocate"] is True and COLOCATE_BELOW_DECODE == 0.5
    # no budget: the share, no verdict
    c = colocation_advice(1.0, 1.0, None)
    assert c["colocate"] is None and c["decode_share"] == 0.5


def test_plan_advice_uses_the_budget_or_the_planned_pools() -> None:
    assert plan(**SWEEP, bounds=Bounds(max_total=4)).advice["colocate"] is True
    assert plan(**SWEEP).advice["colocate"] is None  # no rate, no budget
    assert plan(**SWEEP, request_rate=2.0).advice["budget"] == 3  # 3 prefill + 1 decode
    # counting t_join, the same slice's decode is a fifth of the work: no longer "colocate"
    assert plan(**SWEEP, bounds=Bounds(max_total=4), decode_join_seconds=0.15).advice["colocate"] is False


ARGS = ["plan", "--input-len", "302", "--output-len", "2.8", "--prefill-capacity", "481", "--decode-capacity", "211"]


def test_plan_cli_json_shows_the_term_and_the_advice(capsys) -> None:
    assert main([*ARGS, "--decode-join-seconds", "0.05", "--max-total-replicas", "4", "--request-rate", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["inputs"]["decode_join_seconds"] == 0.05
    assert out["decode_seconds_per_request"] == pytest.approx(2.8 / 211 + 0.05)
    # 63 ms of decode against 628 ms of prefill: of 4 instances the ideal decode pool is 0.36 -> colocate
    assert out["advice"]["colocate"] is True and out["advice"]["budget"] == 4
    assert out["advice"]["ideal_decode"] == pytest.approx(4 * 0.0633 / (0.0633 + 0.6279), rel=0.01)


def test_plan_cli_text_says_colocate(capsys) -> None:
    assert main([*ARGS, "--max-total-replicas", "4"]) == 0
    text = capsys.readouterr().out
    assert "advice:" in text and "does not pay" in text and "--prefill 0" in text
    assert main([*ARGS, "--decode-join-seconds", "0.2"]) == 0
    assert "+ 0.2 s joining" in capsys.readouterr().out


def test_plan_cli_refuses_a_negative_join_time(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main([*ARGS, "--decode-join-seconds", "-1"])
    assert e.value.code == 2 and "--decode-join-seconds" in capsys.readouterr().err


def test_colocate_when_a_prompts_prefill_fits_within_the_tpot_objective() -> None:
    """Colocated won every quiet ratio sweep while the small-decode rule stayed silent (ideal decode pool 0.78 of
    4 in the quiet 6x sweep: I/C_p 0.094 s, decode 0.022 s per request). What disaggregation protects is decode
    steps from waiting for a prefill; a prefill shorter than the TPOT objective breaks nothing to protect."""
    a = colocation_advice(0.094, 0.022, 4)
    assert a["colocate"] is False and a["rule"] is None  # the old rule alone
    a = colocation_advice(0.094, 0.022, 4, slo_tpot=0.5)
    assert a["colocate"] is True and a["rule"] == "prefill-within-tpot"
    assert "fits within the TPOT objective" in a["message"] and "--prefill 0" in a["message"]
    # a prefill longer than the objective (long prompts, or a tight TPOT): decode needs protecting
    assert colocation_advice(0.8, 0.3, 4, slo_tpot=0.5)["colocate"] is False
    assert colocation_advice(0.094, 0.022, 4, slo_tpot=0.05)["colocate"] is False
    # the small-decode rule still fires first, and no budget still means no verdict
    assert colocation_advice(3.6, 0.4, 4, slo_tpot=0.1)["rule"] == "small-decode"
    assert colocation_advice(0.094, 0.022, None, slo_tpot=0.5)["colocate"] is None


def test_plan_cli_slo_tpot_turns_on_the_prefill_rule(capsys) -> None:
    args = ["plan", "--input-len", "228", "--output-len", "20", "--prefill-capacity", "2427", "--decode-capacity",
            "1152", "--decode-join-seconds", "0.005", "--max-total-replicas", "4", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["advice"]["colocate"] is False
    assert main([*args, "--slo-tpot", "0.5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["advice"]["colocate"] is True and out["inputs"]["slo_tpot"] == 0.5
