"""`pdcluster plan` and `pdcluster kv-budget` with tensor parallelism (issue 16 §2): GPUs per planned pool,
KV and weights per rank, and bad layouts as one usage-error line (exit 2)."""

from __future__ import annotations

import json

import pytest

from pdcluster.cli import main

PLAN = ["plan", "--input-len", "2048", "--output-len", "512", "--prefill-capacity", "10000",
        "--decode-capacity", "2000", "--request-rate", "40"]
# Llama-3.1-70B: 80 layers, 64 heads, 8 KV heads of 128; 70.6B parameters
KV70 = ["kv-budget", "--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bf16",
        "--seq-len", "8192", "--batch", "16", "--heads", "64", "--params", "70.6B"]


def _json(capsys: pytest.CaptureFixture[str], args: list[str]) -> dict:
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _usage_error(capsys: pytest.CaptureFixture[str], args: list[str], prog: str) -> str:
    try:
        rc = main(args)
    except SystemExit as e:  # refused by the parser
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"pdcluster {prog}: error:") and "Traceback" not in "\n".join(err)
    return err[-1]


def test_plan_counts_instances_and_reports_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    one = _json(capsys, PLAN)
    tp = _json(capsys, [*PLAN, "--prefill-tp", "4", "--decode-tp", "2"])
    # capacities are per instance: TP changes the GPUs, not the instances
    assert (tp["prefill_replicas"], tp["decode_replicas"]) == (one["prefill_replicas"], one["decode_replicas"]) == (13, 16)
    assert (one["prefill_gpus"], one["decode_gpus"], one["total_gpus"]) == (13, 16, 29)
    assert (tp["prefill_gpus"], tp["decode_gpus"], tp["total_gpus"]) == (52, 32, 84)
    assert (tp["prefill_tp"], tp["decode_tp"]) == (4, 2)
    assert main([*PLAN, "--prefill-tp", "4", "--decode-tp", "2"]) == 0
    assert "GPUs:    52 prefill (13 x TP 4) + 32 decode (16 x TP 2) = 84" in capsys.readouterr().out


def test_plan_without_rate_has_no_gpu_count(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, [*PLAN[:-2], "--decode-tp", "8"])
    assert out["decode_gpus"] is None and out["total_gpus"] is None and out["decode_tp"] == 8


@pytest.mark.parametrize("bad", [["--prefill-tp", "3"], ["--decode-tp", "0"], ["--decode-tp", "32"],
                                 ["--prefill-tp", "two"]])
def test_plan_bad_tp_is_a_usage_error(capsys: pytest.CaptureFixture[str], bad: list[str]) -> None:
    _usage_error(capsys, [*PLAN, *bad], "plan")


def test_kv_budget_70b_at_tp_4_and_8(capsys: pytest.CaptureFixture[str]) -> None:
    """The docs' worked example: 70B at TP 4 vs TP 8."""
    t1 = _json(capsys, KV70)
    t4 = _json(capsys, [*KV70, "--tensor-parallel-size", "4"])
    t8 = _json(capsys, [*KV70, "--tensor-parallel-size", "8"])
    assert t1["bytes_per_token"] == t4["bytes_per_token"] == 327_680  # the model's KV does not change
    assert (t1["kv_heads_per_rank"], t4["kv_heads_per_rank"], t8["kv_heads_per_rank"]) == (8, 2, 1)
    assert (t4["bytes_per_token_per_rank"], t8["bytes_per_token_per_rank"]) == (81_920, 40_960)
    assert t4["total_bytes_per_rank"] == 81_920 * 8192 * 16  # 10.7 GB
    assert t1["weight_bytes"] == t4["weight_bytes"] == 141_200_000_000  # 70.6B x 2 bytes
    assert (t4["weight_bytes_per_rank"], t8["weight_bytes_per_rank"]) == (35_300_000_000, 17_650_000_000)
    assert main([*KV70, "--tensor-parallel-size", "8"]) == 0
    text = capsys.readouterr().out
    assert "per rank:  TP 8: 1 kv head(s) (8 / 8): 40,960 B/token, 5.4 GB" in text
    assert "per rank (TP 8): 17.6 GB" in text and "weights + KV = 23.0 GB" in text


def test_kv_heads_fewer_than_ranks_are_replicated(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, [*KV70, "--tensor-parallel-size", "16"])
    assert (out["kv_heads_per_rank"], out["kv_replication"]) == (1, 2)
    assert out["bytes_per_token_per_rank"] == 40_960  # a replica is a whole head's KV
    assert main([*KV70, "--tensor-parallel-size", "16"]) == 0
    assert "each KV head on 2 ranks" in capsys.readouterr().out


def test_kv_budget_int8_scales_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    args = [a if a != "bf16" else "int8" for a in KV70]
    out = _json(capsys, [*args, "--tensor-parallel-size", "4"])
    assert out["bytes_per_token_per_rank"] == 2 * 80 * 2 * 128
    assert out["total_bytes_with_scales_per_rank"] == (2 * 80 * 2 * 128 + 2 * 80 * 2 * 4) * 8192 * 16


def test_kv_budget_without_params_reports_no_weights(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, [a for a in KV70[:-2]])
    assert "weight_bytes" not in out and out["tensor_parallel_size"] == 1


@pytest.mark.parametrize("bad,needle", [
    (["--tensor-parallel-size", "3"], "invalid choice"),
    (["--kv-heads", "6", "--tensor-parallel-size", "4"], "must divide the KV head count 6"),
    (["--kv-heads", "3", "--tensor-parallel-size", "8"], "must divide tensor parallel size 8"),
    (["--heads", "40", "--tensor-parallel-size", "16"], "attention head count 40"),
    (["--params", "lots"], "not a parameter count"),
    (["--params", "0B"], "must be a positive parameter count"),
    (["--weight-dtype", "fp5"], "invalid choice"),
])
def test_kv_budget_bad_layout_is_a_usage_error(capsys: pytest.CaptureFixture[str], bad: list[str],
                                               needle: str) -> None:
    args = list(KV70)
    for flag, val in zip(bad[::2], bad[1::2], strict=True):
        if flag in args:
            args[args.index(flag) + 1] = val
        else:
            args += [flag, val]
    assert needle in _usage_error(capsys, args, "kv-budget")
