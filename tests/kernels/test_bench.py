"""benchmarks/kernels.py's CPU-safe parts: the --cpu-smoke mode drives the same correctness sweep and timing
loop as the CUDA run, with tiny sizes under the Triton interpreter. No timing assertions."""

from __future__ import annotations

import json

import pytest

from benchmarks import kernels as bench


@pytest.mark.triton
def test_cpu_smoke_writes_json(tmp_path):
    out = tmp_path / "kernels.json"
    assert bench.main(["--cpu-smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["mode"] == "cpu-smoke"
    assert result["correctness"] and all(c["ok"] for c in result["correctness"])
    kinds = {(r["kv"], r["status"]) for r in result["rows"]}
    assert kinds == {("fp16", "ok"), ("int8", "ok"), ("int4", "ok")}
    assert all(r["gbps"] > 0 and "sdpa_us" in r for r in result["rows"])
    assert set(result["goals"]) == {"best_frac_copy_at_longest", "min_int8_speedup_at_longest"}


def test_without_cuda_the_gpu_mode_refuses(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert bench.main([]) == 2
    assert "--cpu-smoke" in capsys.readouterr().err
