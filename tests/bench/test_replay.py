"""`pdcluster bench --trace`: open-loop replay with trace lengths and shared Mooncake prefixes."""

from __future__ import annotations

import json
import random

from pdcluster.bench import replay
from pdcluster.bench.trace import Request
from pdcluster.cli import main


def test_shared_hash_ids_become_shared_prompt_prefixes():
    rng = random.Random(0)
    a = replay.prompt_ids(Request(0, 20, 1, (7, 8, 9)), 8, rng)
    b = replay.prompt_ids(Request(0, 30, 1, (7, 8, 5, 6)), 8, rng)
    c = replay.prompt_ids(Request(0, 12, 1, (1,)), 8, rng)
    assert len(a) == 20 and len(b) == 30 and len(c) == 12
    assert a[:16] == b[:16] and a[16:] != b[16:20]  # blocks 7, 8 shared; then they differ
    assert a[:8] != c[:8]


def test_trace_replay_against_a_server(fake_server, tmp_path):
    s = fake_server()
    lines = [json.dumps({"timestamp": i * 200, "input_length": 40 + i, "output_length": 3,
                         "hash_ids": [0, i]}) for i in range(6)]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    rc = main(["bench", "--url", s.url, "--trace", str(tmp_path / "t.jsonl"), "--speedup", "4",
               "--max-model-len", "32", "--out", str(out)])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == summary["ok"] == 6
    rows = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert all(r["input_tokens"] + r["output_tokens"] <= 32 for r in rows)
    sent = [p for p in s.behaviour.prompts if isinstance(p, list) and len(p) > 8][-6:]
    # sent 50 ms apart (200 ms at speedup 4), so on a loaded machine they may reach the server out of order
    assert sorted(len(p) for p in sent) == sorted(r["input_tokens"] for r in rows)
    # every request names hash id 0 first: their prompts share that block's tokens
    k = min(len(p) for p in sent) // 2
    assert len({tuple(p[:k]) for p in sent}) == 1


def test_trace_replay_bad_input_exit_2(tmp_path, capsys):
    rc = main(["bench", "--url", "http://127.0.0.1:9", "--trace", str(tmp_path / "none.csv"), "--out",
               str(tmp_path / "o")])
    assert rc == 2 and "no such file" in capsys.readouterr().err


def test_trace_replay_keeps_outputs_with_max_output_tokens(fake_server, tmp_path):
    s = fake_server()
    lines = [json.dumps({"timestamp": i * 200, "input_length": 400 * (i + 1), "output_length": 20 + 10 * i})
             for i in range(4)]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    rc = main(["bench", "--url", s.url, "--trace", str(tmp_path / "t.jsonl"), "--speedup", "4",
               "--max-model-len", "128", "--max-output-tokens", "40", "--out", str(out)])
    assert rc == 0
    rows = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert [r["output_tokens"] for r in rows] == [20, 30, 40, 40]  # real lengths, clipped; not shrunk
    assert max(r["input_tokens"] for r in rows) == 128 - 40


def test_max_output_tokens_without_max_model_len_exit_2(tmp_path, capsys):
    (tmp_path / "t.jsonl").write_text(json.dumps({"timestamp": 0, "input_length": 4, "output_length": 2}) + "\n")
    rc = main(["bench", "--url", "http://127.0.0.1:9", "--trace", str(tmp_path / "t.jsonl"),
               "--max-output-tokens", "8", "--out", str(tmp_path / "o")])
    assert rc == 2 and "--max-model-len" in capsys.readouterr().err
