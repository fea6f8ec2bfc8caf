"""Smoke test of bench/native_linear.py: every variant checked against MKL, figures for each row count."""

from __future__ import annotations

from pathlib import Path

from tests.native_marks import needs_native


@needs_native
def test_native_linear_bench_runs(tmp_path: Path) -> None:
    from pdcluster.bench import native_linear

    shapes = native_linear.model_shapes()
    assert len(shapes) == 33 and shapes[-1] == ("lm_head", 32000, 512) and shapes[0] == ("qkv", 1024, 512)
    out = native_linear.main(["--threads", "1", "--rows", "1,3", "--repeats", "1", "--json", str(tmp_path / "o.json")])
    assert set(out["sets"]) == {1, 3} and set(out["per_matrix"]) == {1}
    for row in out["sets"].values():
        assert {"mkl", "kernel", "kernel_1t", "kernel_nt"} <= set(row) and row["kernel"]["ms"] > 0
    assert (tmp_path / "o.json").exists() and out["read_gb_s"] > 0
