"""The stream step of `pdcluster profile` (bench/profile_stream.py): per-request instance-seconds of each pool
from CPU seconds under arrivals, and the formula inputs derived from them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from pdcluster.bench import profile_stream as ps
from pdcluster.bench.profile import format_report, summarize
from pdcluster.operator.planner import seconds_per_request


def test_cpu_seconds_reads_the_process_collector_series() -> None:
    text = "# HELP process_cpu_seconds_total x\n# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 12.5\n"
    assert ps.cpu_seconds(text) == 12.5
    assert ps.cpu_seconds("pdcluster_requests_total 3\n") is None


def test_instance_seconds_take_off_the_idle_burn_and_divide_by_the_limit() -> None:
    # 10 CPU s over 20 s, of which 0.05 CPU/s idle (1 CPU s): 9 CPU s for 90 requests = 0.1 CPU s each;
    # at a 0.4-CPU limit one request holds an instance for 0.25 s.
    assert ps.instance_seconds_per_request(10.0, 0.05, 20.0, 90, 0.4) == pytest.approx(0.25)
    assert ps.instance_seconds_per_request(0.5, 0.05, 20.0, 90, 0.4) == 0.0  # noisy idle: never negative
    assert ps.instance_seconds_per_request(10.0, 0.0, 20.0, 0, 0.4) is None
    with pytest.raises(ValueError):
        ps.instance_seconds_per_request(10.0, 0.0, 20.0, 5, 0.0)


def test_stream_costs_feed_the_formula_unchanged() -> None:
    """What the stream measured comes back out of the formula: I/C_p' = prefill s, O/C_d + t_join' = decode s."""
    st = {"prefill_seconds": 0.12, "decode_seconds": 0.09, "input_len": 228, "output_len": 20}
    c = ps.stream_costs(st, decode_capacity=1000.0)
    assert c["decode_join_seconds"] == pytest.approx(0.07) and c["prefill_tokens_per_second"] == pytest.approx(1900)
    sp, sd = seconds_per_request(228, 20, c["prefill_tokens_per_second"], 1000.0, c["decode_join_seconds"])
    assert (sp, sd) == (pytest.approx(0.12), pytest.approx(0.09))
    # a decode cheaper under the stream than O/C_d says: no negative join time
    assert ps.stream_costs({**st, "decode_seconds": 0.01}, 1000.0)["decode_join_seconds"] == 0.0
    assert ps.stream_costs(st, None)["decode_join_seconds"] is None


@dataclass
class _R:
    ok: bool


def test_measure_reads_each_pool_around_an_idle_span_and_the_stream() -> None:
    cpu = {"p1": [1.0, 1.1, 5.1], "p2": [2.0, 2.1, 6.1], "d1": [3.0, 3.2, 9.2]}  # per read: t0, idle end, end
    reads = {u: iter(v) for u, v in cpu.items()}
    times = iter([0.0, 2.0, 12.0])

    async def read(u: str) -> str:
        return f"process_cpu_seconds_total {next(reads[u])}\n"

    sent = []

    async def send(n: int, i: int, o: int, rate: float):
        sent.append((n, i, o, rate))
        return [_R(True)] * 39 + [_R(False)], 10.0

    out = asyncio.run(ps.measure(read, send, {"prefill": ["p1", "p2"], "decode": ["d1"]}, rate=4.0, requests=40,
                                 input_len=228, output_len=20, instance_cpus=0.5, idle_s=0.0, warmup=5,
                                 clock=lambda: next(times)))
    assert sent == [(5, 228, 20, 4.0), (40, 228, 20, 4.0)]  # uncounted warm-up first, at the same rate
    # prefill: 8 CPU s, idle 0.1 CPU/s x 10 s = 1 -> 7 / 39 ok / 0.5; decode: 6 - 0.1 x 10 = 5 -> 5 / 39 / 0.5
    assert out["prefill_seconds"] == pytest.approx(7 / 39 / 0.5)
    assert out["decode_seconds"] == pytest.approx(5 / 39 / 0.5)
    assert out["ok"] == 39 and out["workers"] == {"prefill": 2, "decode": 1}


def test_report_prints_the_plan_flags_of_the_stream() -> None:
    raw = {"target": "http://r", "prefill": [{"concurrency": 1, "prompt_tokens_per_second": 2400.0, "errors": 0}],
           "decode": [{"batch": 8, "output_tokens_per_second": 1000.0, "tpot_p50": 0.008, "errors": 0}],
           "stream": {"rate": 4.0, "requests": 40, "ok": 40, "input_len": 228, "output_len": 20,
                      "instance_cpus": 0.4, "prefill_seconds": 0.12, "decode_seconds": 0.09}}
    s = summarize(raw)
    assert s["stream_costs"]["decode_join_seconds"] == pytest.approx(0.07)
    text = format_report(s)
    assert "--prefill-capacity 1900 --decode-capacity 1000 --decode-join-seconds 0.07" in text
