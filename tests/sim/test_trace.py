"""Trace readers, scaling, windows and the summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdcluster.bench import trace as tr

REAL = Path(__file__).resolve().parents[3] / "shared" / "traces"

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:04.0319600,300,8
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:18:05.5000000,110,27
"""


def mooncake(rows: list[dict]) -> str:
    return "\n".join(json.dumps(r) for r in rows) + "\n"


def test_azure_csv_sorted_rebased_and_subsecond_timestamps():
    t = tr.parse_trace(AZURE, "a.csv")
    assert t.schema == "azure"
    assert [r.input_tokens for r in t.requests] == [4808, 300, 110]
    assert t.requests[0].t == 0.0
    assert t.requests[1].t == pytest.approx(0.052, abs=1e-6)  # 7 fractional digits kept to the microsecond
    assert t.requests[2].t == pytest.approx(61.52004, abs=1e-6)
    assert all(r.hash_ids is None for r in t.requests)


def test_azure_any_column_order_and_case():
    t = tr.parse_trace("generatedtokens,TIMESTAMP,contexttokens\n5,10.5,100\n6,10.0,200\n", "b.csv")
    assert [(r.t, r.input_tokens, r.output_tokens) for r in t.requests] == [(0.0, 200, 6), (0.5, 100, 5)]


def test_mooncake_jsonl_with_hashes():
    t = tr.parse_trace(mooncake([
        {"timestamp": 1500, "input_length": 1024, "output_length": 3, "hash_ids": [0, 1]},
        {"timestamp": 500, "input_length": 600, "output_length": 9, "hash_ids": [0, 2]},
    ]))
    assert t.schema == "mooncake"
    assert [(r.t, r.input_tokens, r.hash_ids) for r in t.requests] == [(0.0, 600, (0, 2)), (1.0, 1024, (0, 1))]
    # hash_ids are optional: other Mooncake traces may lack them
    t2 = tr.parse_trace(mooncake([{"timestamp": 0, "input_length": 5, "output_length": 1}]))
    assert t2.requests[0].hash_ids is None


@pytest.mark.parametrize("text, needle", [
    ("", "empty"),
    ("time,in,out\n1,2,3\n", "lacks 'TIMESTAMP'"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:04,-3,1\n", ":2:"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,3,1\n", ":2:"),
    ('{"timestamp": 0, "input_length": 5}\n', "missing output_length"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}\n[1]\n', ":2:"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["x"]}\n', "hash_ids"),
    ('{"timestamp": 0, "input_length": 5.5, "output_length": 1}\n', "integer"),
])
def test_bad_traces_raise_trace_error(text, needle):
    with pytest.raises(tr.TraceError, match=needle):
        tr.parse_trace(text, "x")


def test_read_trace_file_errors(tmp_path):
    with pytest.raises(tr.TraceError, match="no such file"):
        tr.read_trace(tmp_path / "missing.csv")
    with pytest.raises(tr.TraceError, match="directory"):
        tr.read_trace(tmp_path)
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(tr.TraceError, match="not a text file"):
        tr.read_trace(tmp_path / "bin")


def test_time_scaling_window_and_length_scaling():
    t = tr.parse_trace(mooncake([
        {"timestamp": i * 1000, "input_length": 1000 * (i + 1), "output_length": 100, "hash_ids": [i]}
        for i in range(10)]))
    fast = tr.scale_time(t, 2.0)
    assert fast.duration_s == pytest.approx(4.5)
    with pytest.raises(tr.TraceError):
        tr.scale_time(t, 0)
    w = tr.time_window(t, 3.0, 6.0)
    assert [r.input_tokens for r in w.requests] == [4000, 5000, 6000] and w.requests[0].t == 0.0
    with pytest.raises(tr.TraceError, match="no requests"):
        tr.time_window(t, 100.0)
    s = tr.scale_lengths(t, 512)
    assert max(r.input_tokens + r.output_tokens for r in s.requests) <= 512
    # one factor for all: the length mix keeps its shape
    assert s.requests[9].input_tokens == pytest.approx(10 * s.requests[0].input_tokens, rel=0.1)
    assert s.block_tokens < t.block_tokens
    assert tr.scale_lengths(t, 100_000) is t


def test_summary_of_synthetic_trace():
    t = tr.parse_trace(mooncake([{"timestamp": i * 500, "input_length": 100 + i, "output_length": 10}
                                 for i in range(200)]))
    s = tr.summarize(t)
    assert s["requests"] == 200
    assert s["duration_s"] == pytest.approx(99.5)
    assert s["mean_input_tokens"] == pytest.approx(100 + 199 / 2)
    assert s["p50_input_tokens"] == 199 and s["p99_input_tokens"] == 297
    assert s["peak_minute_requests"] == 120 and s["peak_minute_rate_rps"] == pytest.approx(2.0)
    assert s["mean_output_tokens"] == 10


@pytest.mark.skipif(not REAL.is_dir(), reason=f"the shared production traces are not beside this checkout ({REAL})")
@pytest.mark.parametrize("name, schema, first", [
    ("azure2023_code.csv", "azure", (4808, 10)),
    ("mooncake_conversation.jsonl", "mooncake", (6758, 500)),
])
def test_real_file_first_rows(tmp_path, name, schema, first):
    lines = (REAL / name).read_text().splitlines()[:50]
    t = tr.parse_trace("\n".join(lines) + "\n", name)
    assert t.schema == schema
    assert len(t.requests) == (49 if schema == "azure" else 50)
    assert (t.requests[0].input_tokens, t.requests[0].output_tokens) == first
    assert all(b.t >= a.t for a, b in zip(t.requests, t.requests[1:], strict=False))
    if schema == "mooncake":
        assert t.requests[0].hash_ids[:3] == (0, 1, 2)


def test_fit_prompts_keeps_real_output_lengths_clipped_to_the_cap():
    # Azure-code-like: long prompts, short outputs; scale_lengths would crush outputs of 28 to ~3.
    t = tr.parse_trace(mooncake([{"timestamp": i * 100, "input_length": 700 * (i + 1), "output_length": o,
                                  "hash_ids": [1, 2]} for i, o in enumerate([28, 5, 400, 1, 60])]))
    f = tr.fit_prompts(t, 1024, 256)
    assert [r.output_tokens for r in f.requests] == [28, 5, 256, 1, 60]  # real, clipped to 256
    assert max(r.input_tokens for r in f.requests) == 1024 - 256  # the longest prompt fills the room left
    assert all(r.input_tokens + r.output_tokens <= 1024 for r in f.requests)
    # one factor for the prompts: the mix keeps its shape; blocks shrink with them
    assert f.requests[4].input_tokens == pytest.approx(5 * f.requests[0].input_tokens, rel=0.02)
    assert f.block_tokens < t.block_tokens
    crushed = tr.scale_lengths(t, 1024)
    assert crushed.requests[0].output_tokens < 10  # what the flag exists to avoid
    # prompts that already fit are kept as they are
    assert [r.input_tokens for r in tr.fit_prompts(t, 10_000, 64).requests] == [r.input_tokens for r in t.requests]
    for bad in ((100, 0), (100, 100)):
        with pytest.raises(tr.TraceError, match="max output"):
            tr.fit_prompts(t, *bad)
