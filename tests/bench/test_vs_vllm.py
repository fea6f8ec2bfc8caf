"""benchmarks/vs_vllm.py without running vLLM: it skips cleanly (exit 0, one line) where no interpreter imports
vllm — what `make bench` and scripts/gpu-bench.sh rely on — and its table reads medians, spread and ratios
the way docs/benchmarks.md quotes them. The full run is `make bench` (figures in docs/benchmarks.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.vs_vllm import summary, table, tree_cpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("python", ["/nonexistent/python", sys.executable])
def test_skips_cleanly_without_vllm(python: str) -> None:
    env = {**os.environ, "PDCLUSTER_VLLM_PYTHON": python}
    r = subprocess.run([sys.executable, "-m", "benchmarks.vs_vllm", "--rounds", "1"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("benchmarks.vs_vllm: skipped: "), r.stdout


def test_table_reports_median_spread_and_ratio() -> None:
    rows = summary({"pdcluster": {"decode_b1_tok_s": [100.0, 120.0, 90.0], "ttft_512_s": [0.1, 0.3, 0.2]},
                    "vllm": {"decode_b1_tok_s": [50.0, 60.0, 80.0], "ttft_512_s": [0.4]}})
    assert rows[0]["ratio"] == 100.0 / 60.0 and rows[1]["vllm"] == {"median": 0.4, "min": 0.4, "max": 0.4, "n": 1}
    text = table(rows)
    assert "| decode_b1_tok_s | 100 tok/s [90-120] | 60 tok/s [50-80] | 1.67x |" in text
    assert "| ttft_512_s | 200 ms [100-300] | 400 ms [400-400] | 0.50x |" in text


def test_tree_cpu_counts_children() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', "
                             "'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.5: pass\\n"
                             "print(1, flush=True)\\ninput()'])"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert busy.stdout is not None and busy.stdout.readline().strip() == "1"  # the child has burnt 0.5 s
        # /proc's utime+stime are sampled at clock ticks, so they can trail process_time(): a margin, not 0.5
        assert tree_cpu(busy.pid) >= 0.3
    finally:
        busy.communicate("\n", timeout=60)
