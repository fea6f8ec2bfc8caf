"""bench/fused_step.py on a short workload: both sides run, their greedy tokens agree, the ratios are reported."""

from __future__ import annotations

import json
from pathlib import Path

from pdcluster.bench import fused_step
from tests.native_marks import needs_native


@needs_native
def test_a_short_run_reports_both_sides(tmp_path: Path) -> None:
    out = tmp_path / "fused.json"
    got = fused_step.main(["--threads", "1", "--batches", "2", "--repeats", "2", "--prompt-len", "8",
                           "--new-tokens", "4", "--json", str(out)])
    row = got["batches"][2]
    assert row["plan_step_ms"] > 0 and row["modules_step_ms"] > 0 and row["speedup_paired_median"] > 0
    assert json.loads(out.read_text())["batches"]["2"] == row
