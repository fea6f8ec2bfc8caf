"""Knee detection (pure), the capacity block, and `pdcluster profile` over HTTP and in-process."""

import json

import pytest
import yaml

from pdcluster.bench.capacity import capacity_yaml, choose_decode_batch, find_knee
from pdcluster.bench.profile import format_report, summarize
from pdcluster.cli import main


def test_knee_of_a_saturating_curve():
    pts = [(1, 100), (2, 190), (4, 350), (8, 560), (16, 640), (32, 660), (64, 665)]
    assert find_knee(pts) == (16, 640)  # first to reach 90% of 665
    assert find_knee(pts, frac=0.8) == (8, 560)
    assert find_knee(list(reversed(pts))) == (16, 640)  # order does not matter


def test_a_linear_curve_has_no_knee_and_recommends_the_largest_batch():
    pts = [(b, 10.0 * b, 0.01) for b in (1, 2, 4, 8, 16, 32, 64)]
    k = choose_decode_batch(pts)
    assert (k.batch, k.found) == (64, False) and "no knee found" in k.reason


def test_knee_tolerates_a_noisy_dip_and_a_past_peak_decline():
    pts = [(1, 100), (2, 150), (4, 140), (8, 400), (16, 420), (32, 380)]
    assert find_knee(pts) == (8, 400)
    assert choose_decode_batch([(b, t, None) for b, t in pts]).found


def test_tpot_slo_caps_the_batch():
    pts = [(1, 100, 0.010), (2, 190, 0.011), (4, 350, 0.012), (8, 560, 0.015), (16, 640, 0.025), (32, 660, 0.05)]
    assert choose_decode_batch(pts).batch == 16
    k = choose_decode_batch(pts, tpot_slo=0.02)
    assert (k.batch, k.throughput, k.limited_by_slo) == (8, 560, True)
    assert choose_decode_batch(pts, tpot_slo=0.1).limited_by_slo is False
    k = choose_decode_batch(pts, tpot_slo=0.001)  # nothing meets it: smallest batch, flagged
    assert (k.batch, k.limited_by_slo) == (1, True)


def _raw(curve):
    return {"target": "t", "prefill": [{"concurrency": 1, "prompt_tokens_per_second": 900.0, "errors": 0}],
            "decode": [{"batch": b, "output_tokens_per_second": t, "tpot_p50": b / t, "errors": 0}
                       for b, t in curve]}


# (curve, knee found, recommended batch)
CURVES = {
    "still growing": ([(1, 100.0), (2, 190.0), (4, 370.0)], False, 4),
    "last step adds under 11%": ([(1, 100.0), (2, 190.0), (4, 340.0), (8, 372.0)], True, 4),
    "saturating": ([(1, 100.0), (2, 190.0), (4, 350.0), (8, 560.0), (16, 640.0), (32, 660.0)], True, 16),
    "one batch only": ([(8, 500.0)], False, 8),
    "past-peak decline": ([(1, 100.0), (2, 300.0), (4, 280.0)], True, 2),
}


@pytest.mark.parametrize("name", CURVES)
def test_report_and_capacity_block_say_what_the_knee_detection_found(name):
    curve, found, batch = CURVES[name]
    s = summarize(_raw(curve))
    report = format_report(s)
    doc = yaml.safe_load(report[report.index("# pdcluster profile"):])
    assert s["decode_knee"]["found"] is found and s["recommended_max_batch_size"] == batch
    assert doc["spec"]["decode"]["maxBatchSize"] == batch
    yaml_line = next(line for line in report.splitlines() if "maxBatchSize" in line)
    if found:
        assert f"{batch:>5}" in next(line for line in report.splitlines() if line.endswith("<- knee"))
        assert "still growing" not in report and "the knee" in yaml_line
    else:  # never "knee" next to "still growing" (the report once said both)
        assert "<- knee" not in report and "the knee" not in yaml_line
        assert f"no knee found: throughput still growing at batch {batch}, the largest measured" in report
        assert "largest measured (no knee)" in report and "no knee found" in yaml_line


@pytest.mark.parametrize("bad", [[], [(1, None)]])
def test_knee_needs_data(bad):
    with pytest.raises(ValueError):
        find_knee(bad)


def test_capacity_yaml_is_a_valid_spec_fragment():
    text = capacity_yaml(12345.6, 2345.9, max_batch_size=16, comment="measured\non a laptop")
    doc = yaml.safe_load(text)
    assert doc["spec"]["autoscaling"]["capacity"] == {"prefillTokensPerSecond": 12345, "decodeTokensPerSecond": 2345}
    assert doc["spec"]["decode"]["maxBatchSize"] == 16
    assert text.startswith("# measured\n# on a laptop\n")


def test_summarize_is_pure_and_picks_the_knee():
    raw = {"target": "t",
           "prefill": [{"concurrency": 1, "prompt_tokens_per_second": 800.0, "errors": 0},
                       {"concurrency": 4, "prompt_tokens_per_second": 1000.0, "errors": 0}],
           "decode": [{"batch": b, "output_tokens_per_second": t, "tpot_p50": b / t, "errors": 0}
                      for b, t in [(1, 50.0), (4, 180.0), (16, 300.0), (64, 310.0)]]}
    s = summarize(raw)
    assert s["prefill_tokens_per_second"] == 1000.0 and s["prefill_knee_concurrency"] == 4
    assert s["recommended_max_batch_size"] == 16 and s["decode_tokens_per_second"] == 300.0
    assert "decode_knee" not in raw  # input untouched


def test_profile_url_against_fake_server(fake_server, capsys):
    s = fake_server()
    rc = main(["profile", "--url", s.url, "--batch-sizes", "1,2,4", "--prefill-len", "32",
               "--prefill-concurrency", "1,2", "--decode-len", "6", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [d["batch"] for d in out["decode"]] == [1, 2, 4]
    assert out["prefill_tokens_per_second"] > 0 and out["decode_tokens_per_second"] > 0
    assert out["recommended_max_batch_size"] in (1, 2, 4)


def test_profile_unreachable_url_is_a_message(free_port, capsys):
    assert main(["profile", "--url", f"http://127.0.0.1:{free_port}", "--batch-sizes", "1"]) == 1
    err = capsys.readouterr().err
    assert "connect" in err and "Traceback" not in err
    assert main(["profile", "--url", "nope", "--batch-sizes", "1"]) == 2


@pytest.mark.slow
def test_profile_model_in_process_compares_block_sizes(tmp_path, capsys):
    from pdcluster.worker.local.demo_model import build_demo_model

    model = build_demo_model(tmp_path / "m", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             tokenizer=False)  # no BPE training: faster
    rc = main(["profile", "--model", str(model), "--batch-sizes", "1,2", "--prefill-len", "32",
               "--prefill-requests", "2", "--decode-len", "4", "--repeats", "1", "--block-sizes", "16,32"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "block size 32 vs 16" in out and "decodeTokensPerSecond" in out


def test_join_seconds_from_two_metric_readings():
    from pdcluster.bench.profile import join_seconds, join_totals

    text = ('# HELP pdcluster_decode_join_seconds x\n'
            'pdcluster_decode_join_seconds_bucket{le="0.05",role="decode"} 3.0\n'
            'pdcluster_decode_join_seconds_sum{role="decode"} 0.12\n'
            'pdcluster_decode_join_seconds_count{role="decode"} 4.0\n'
            'pdcluster_decode_join_seconds_count_other{role="decode"} 99.0\n')
    assert join_totals(text) == (0.12, 4.0)
    assert join_totals("pdcluster_requests_total 3.0\n") == (0.0, 0.0)  # a worker without the series
    tpot = 'pdcluster_time_per_output_token_seconds_sum{role="decode"} 0.5\n' \
           'pdcluster_time_per_output_token_seconds_count{role="decode"} 50.0\n'
    assert join_totals(text + tpot, "pdcluster_time_per_output_token_seconds") == (0.5, 50.0)
    assert join_seconds((0.12, 4.0), (0.52, 14.0)) == pytest.approx(0.04)
    assert join_seconds((0.12, 4.0), (0.12, 4.0)) is None  # nothing joined: unknown, not 0


def test_profile_of_a_worker_without_a_router_has_no_join_time(fake_server, capsys):
    s = fake_server()
    rc = main(["profile", "--url", s.url, "--batch-sizes", "1", "--prefill-len", "32", "--prefill-concurrency", "1",
               "--decode-len", "4", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["decode_join"] is None and out["decode_join_seconds"] is None
