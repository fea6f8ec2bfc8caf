"""bench/native_attention.py runs end to end on a tiny case (the figures themselves live in the docs)."""

from __future__ import annotations

from pdcluster.bench import native_attention
from tests.native_marks import needs_native


@needs_native
def test_layer_case_times_every_variant_and_checks_they_agree():
    row = native_attention.layer_case([5, 40, 17], repeats=3)
    assert native_attention.layer_case([5, 40], repeats=2, kv="int8")["native"]["median"] > 0
    assert set(row) == {"torch", "torch 1 thread", "native", "native 1 thread", "torch/native"}
    assert all(row[k]["median"] > 0 for k in ("torch", "native"))
    assert set(row["torch/native"]) == {"", " 1 thread"}
