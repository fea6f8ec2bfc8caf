"""`pdcluster bench` end to end against the fake server: files, compare, and failures without tracebacks."""

import csv
import json

import pytest

from pdcluster.bench import heatmap
from pdcluster.bench.stats import CELL_FIELDS
from pdcluster.cli import main

GRID = ["--prompt-lens", "4,16", "--output-lens", "2,5", "--requests", "3", "--no-progress"]


def bench(*argv):
    return main(["bench", *argv])


def test_grid_sweep_writes_results_csv_and_heatmaps(fake_server, tmp_path, capsys):
    s = fake_server()
    assert bench("--url", s.url, *GRID, "--concurrency", "2", "--out", str(tmp_path)) == 0
    cells = json.loads((tmp_path / "results.json").read_text())
    assert isinstance(cells, list) and len(cells) == 4
    assert {(c["prompt_len"], c["output_len"]) for c in cells} == {(4, 2), (4, 5), (16, 2), (16, 5)}
    for c in cells:
        assert set(CELL_FIELDS) <= set(c)
        assert c["completed"] == 3 and c["errors"] == 0
        assert c["mean_output_tokens"] == c["output_len"]  # ignore_eos + max_tokens: exact lengths
        assert c["ttft_p50"] > 0 and c["output_tokens_per_second"] > 0
    # exact prompt lengths as token ids (the warmup and probe requests come first)
    assert sorted({len(p) for p in s.behaviour.prompts[-12:]}) == [4, 16]
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert len(rows) == 4 and list(rows[0]) == CELL_FIELDS
    assert len((tmp_path / "requests.jsonl").read_text().splitlines()) == 12
    for key in heatmap.METRICS:
        png = tmp_path / f"heatmap_{key}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["model"] == "fake-model" and meta["mode"] == "closed"
    assert "12/12 requests succeeded" in capsys.readouterr().out


def test_compare_writes_ratio_maps(fake_server, tmp_path):
    s = fake_server()
    a, b = tmp_path / "a", tmp_path / "b"
    assert bench("--url", s.url, *GRID, "--out", str(a), "--no-plots") == 0
    assert bench("--url", s.url, *GRID, "--rate", "50", "--out", str(b), "--compare", str(a)) == 0
    ratios = json.loads((b / "ratio.json").read_text())
    assert len(ratios) == 4 and all(r["ttft_p50"] > 0 for r in ratios)
    assert (b / "ratio_output_tokens_per_second.png").exists()
    assert json.loads((b / "meta.json").read_text())["mode"] == "open"


def test_ratio_maps_are_titled_with_the_run_labels(fake_server, tmp_path, monkeypatch):
    s = fake_server()
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert bench("--url", s.url, *GRID, "--out", str(a), "--no-plots", "--label", "colocated") == 0
    titles: list[str] = []
    real = heatmap.plot
    monkeypatch.setattr(heatmap, "plot", lambda cells, key, path, title="", ratio=False:
                        titles.append(title) or real(cells, key, path, title, ratio))
    assert bench("--url", s.url, *GRID, "--out", str(b), "--compare", str(a / "results.json"),
                 "--label", "disaggregated") == 0
    ratio_titles = titles[len(heatmap.METRICS):]
    assert ratio_titles and all(t.endswith(" (disaggregated / colocated)") for t in ratio_titles)
    titles.clear()  # no labels given: the folders' names, never "this / results.json"
    assert bench("--url", s.url, *GRID, "--out", str(c), "--compare", str(b / "results.json")) == 0
    assert all(t.endswith(" (c / disaggregated)") for t in titles[len(heatmap.METRICS):])


def test_error_responses_are_counted(fake_server, tmp_path, capsys):
    s = fake_server(fail_every=3)
    assert bench("--url", s.url, *GRID, "--concurrency", "1", "--warmup", "0", "--out", str(tmp_path)) == 0
    cells = json.loads((tmp_path / "results.json").read_text())
    errors = sum(c["errors"] for c in cells)
    assert errors >= 3 and all(set(c["error_kinds"]) <= {"http_500"} for c in cells)
    assert sum(c["completed"] for c in cells) + errors == 12
    assert "http_500" in capsys.readouterr().out


def test_a_dead_url_fails_and_writes_nothing(free_port, tmp_path, capsys):
    out = tmp_path / "run"
    rc = bench("--url", f"http://127.0.0.1:{free_port}", *GRID, "--out", str(out))
    assert rc == 1
    stdout, err = capsys.readouterr()
    assert "Traceback" not in stdout + err
    assert "is not serving completions (connect" in err and "nothing written" in err
    assert not out.exists()  # no results.json, no heat map, not even the folder


def test_a_server_refusing_everything_fails_and_writes_nothing(fake_server, tmp_path, capsys):
    s = fake_server(status=503)
    (tmp_path / "results.json").write_text("[]")  # an earlier run's files stay as they were
    assert bench("--url", s.url, *GRID, "--out", str(tmp_path)) == 1
    assert "http_503" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
    assert (tmp_path / "results.json").read_text() == "[]"


@pytest.mark.parametrize(
    "argv",
    [
        ["--url", "localhost:1", "--prompt-lens", "4", "--output-lens", "2"],
        ["--url", "http://127.0.0.1:1", "--prompt-lens", "4,x", "--output-lens", "2"],
        ["--url", "http://127.0.0.1:1", "--prompt-lens", "4", "--output-lens", "2", "--requests", "0"],
        ["--url", "http://127.0.0.1:1", "--prompt-lens", "4", "--output-lens", "2", "--compare", "/nonexistent"],
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv, tmp_path, capsys):
    try:
        rc = bench(*argv, "--out", str(tmp_path))
    except SystemExit as e:  # a bad number is refused at parse time (--requests 0)
        rc = e.code
    assert rc == 2
    out, err = capsys.readouterr()
    assert "pdcluster bench:" in err and "Traceback" not in out + err


def test_text_fallback_when_ids_rejected(fake_server, tmp_path, capsys):
    s = fake_server(reject_ids=True)
    assert bench("--url", s.url, "--prompt-lens", "8", "--output-lens", "3", "--requests", "2",
                 "--no-progress", "--no-plots", "--out", str(tmp_path)) == 0
    assert "text prompts" in capsys.readouterr().err
    assert isinstance(s.behaviour.prompts[-1], str)
