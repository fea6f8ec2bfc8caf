"""Alert rules, runbooks and the Grafana dashboard: valid, consistent with each other and with the metric
names that workers and the router export (worker/api/metrics.py; docs/architecture.md) and the operator's,
and (when promtool is installed) checked and unit-tested by promtool."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "observability" / "prometheus-rules.yaml"
DASHBOARD = ROOT / "observability" / "grafana-dashboard.json"
RUNBOOKS = ROOT / "docs" / "runbooks"

# The metric contract workers and the router export (worker/api/metrics.py; docs/architecture.md, "Serving")
DESIGN_SERIES = {
    "pdcluster_requests_total", "pdcluster_prompt_tokens_total", "pdcluster_generation_tokens_total",
    "pdcluster_time_to_first_token_seconds", "pdcluster_time_per_output_token_seconds",
    "pdcluster_requests_waiting", "pdcluster_requests_running", "pdcluster_kv_cache_used_blocks",
    "pdcluster_kv_cache_usage_ratio", "pdcluster_preemptions_total", "pdcluster_kv_transfer_bytes_total",
    "pdcluster_kv_transfer_seconds", "pdcluster_kv_transfer_failures_total", "pdcluster_requests_rejected_total",
}
# Issue 14's additions: request phases, lengths, finish reasons, prefix-cache counters, build info
ADDED_SERIES = {
    "pdcluster_request_phase_seconds", "pdcluster_e2e_request_latency_seconds", "pdcluster_request_prompt_tokens",
    "pdcluster_request_generation_tokens", "pdcluster_request_success_total",
    "pdcluster_prefix_cache_query_tokens_total", "pdcluster_prefix_cache_hit_tokens_total", "pdcluster_build_info",
    "pdcluster_decode_join_seconds",  # issue 13: the decode pool's per-request admission cost (t_join)
    # issue 12: the native CPU kernels' work-sharing pool (calls, shared, stalls)
    "pdcluster_native_pool_calls_total", "pdcluster_native_pool_shared_calls_total",
    "pdcluster_native_pool_stalls_total",
    "pdcluster_native_kernel_loaded",  # 1 per native module that runs, 0 where its torch path runs
}
HISTOGRAMS = {"pdcluster_time_to_first_token_seconds", "pdcluster_time_per_output_token_seconds",
              "pdcluster_kv_transfer_seconds", "pdcluster_request_phase_seconds",
              "pdcluster_e2e_request_latency_seconds", "pdcluster_request_prompt_tokens",
              "pdcluster_request_generation_tokens", "pdcluster_decode_join_seconds"}
RUNBOOK_URL = re.compile(r"^https://\S+/docs/runbooks/(?P<alert>[A-Za-z]+)\.md$")
METRIC = re.compile(r"\b(pdcluster[_:][A-Za-z0-9_:]*)")


def operator_series() -> set[str]:
    from pdcluster.operator import opmetrics

    out = set()
    for fam in opmetrics.REGISTRY.collect():
        out.add(fam.name + ("_total" if fam.type == "counter" else ""))
    return out


def rules() -> dict:
    return yaml.safe_load(RULES.read_text())


def all_rules() -> list[dict]:
    return [r for g in rules()["groups"] for r in g["rules"]]


def allowed_series() -> set[str]:
    recorded = {r["record"] for r in all_rules() if "record" in r}
    hist = {h + s for h in HISTOGRAMS for s in ("_bucket", "_count", "_sum")}
    return DESIGN_SERIES | ADDED_SERIES | hist | operator_series() | recorded


def test_worker_metrics_module_exports_the_design_names():
    from pdcluster.worker.api.metrics import SERIES

    assert set(SERIES) == DESIGN_SERIES | ADDED_SERIES


def test_rules_file_is_plain_prometheus_groups():
    doc = rules()
    assert set(doc) == {"groups"}  # the chart wraps `groups` into a PrometheusRule
    names = [g["name"] for g in doc["groups"]]
    assert len(names) == len(set(names))


def test_every_alert_has_severity_summary_and_an_existing_runbook():
    alerts = [r for r in all_rules() if "alert" in r]
    assert {a["alert"] for a in alerts} >= {
        "PDClusterTTFTSLOBurn", "PDClusterTPOTSLOBurn", "PDClusterKVCachePressure", "PDClusterQueueGrowing",
        "PDClusterKVTransferFailures", "PDClusterScalingLimited", "PDClusterMetricsMissing",
    }
    for a in alerts:
        assert a["labels"]["severity"] in {"page", "ticket", "warning", "info"}, a["alert"]
        assert a["annotations"]["summary"] and a["annotations"]["description"]
        m = RUNBOOK_URL.match(a["annotations"]["runbook_url"])
        assert m and m["alert"] == a["alert"], a["annotations"]["runbook_url"]
        assert (RUNBOOKS / f"{a['alert']}.md").is_file(), f"missing docs/runbooks/{a['alert']}.md"


def test_burn_rate_alerts_are_multiwindow():
    for a in all_rules():
        if a.get("alert", "").endswith("SLOBurn"):
            windows = set(re.findall(r"ratio_rate(\w+)", a["expr"]))
            assert len(windows) == 4, (a["alert"], windows)  # two long/short pairs per rule


def test_rules_reference_only_known_series():
    allowed = allowed_series()
    for r in all_rules():
        used = set(METRIC.findall(r["expr"]))
        assert used, r
        assert used <= allowed, (r.get("alert") or r.get("record"), used - allowed)


def test_runbook_pages_have_the_sections_and_commands():
    alerts = {r["alert"] for r in all_rules() if "alert" in r}
    readme = (RUNBOOKS / "README.md").read_text()
    for alert in alerts:
        assert f"({alert}.md)" in readme, f"README does not link {alert}"
        text = (RUNBOOKS / f"{alert}.md").read_text()
        assert text.startswith(f"# {alert}")
        for section in ("## What users see", "## Commands", "## Fix"):
            assert section in text, (alert, section)
        assert "kubectl" in text and "pdc" in text
    for needle in ("kubectl get pdc", "kubectl describe pdc", "pdcluster plan", "pdcluster kv-budget",
                   "pdcluster profile", "## Troubleshooting table", "## Known traps"):
        assert needle in readme, needle
    for trap in ("short-prompt", "every layer", "host memory", "backpressure"):
        assert trap in readme.lower(), trap


def test_dashboard_is_valid_and_uses_known_series_only():
    d = json.loads(DASHBOARD.read_text())
    allowed = allowed_series()
    ids, titles, exprs = set(), [], []
    for p in d["panels"]:
        assert p["id"] not in ids
        ids.add(p["id"])
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
        titles.append(p["title"])
        exprs += [t["expr"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in d["annotations"]["list"]]
    for e in exprs:
        used = set(METRIC.findall(e))
        assert used and used <= allowed, (e, used - allowed)
    joined = " | ".join(titles)
    for want in ("TTFT p50 / p99 by role", "TPOT p50 / p99 by role", "Prefill queue", "Transfer queue",
                 "Decode queue", "KV usage", "Preemptions", "Transfer bandwidth", "Transfer latency",
                 "Transfer failures", "Replicas", "Ratio D/P", "Autoscaler decisions"):
        assert want in joined, want
    used_all = set(METRIC.findall(" ".join(exprs)))
    assert {"pdcluster_autoscaler_desired_replicas", "pdcluster_autoscaler_decisions_total"} <= used_all


def test_dashboard_json_is_what_the_generator_writes(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_dashboard", ROOT / "observability" / "build_dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert json.loads(DASHBOARD.read_text()) == mod.build(), "run: python observability/build_dashboard.py"


@pytest.mark.skipif(shutil.which("promtool") is None and not os.environ.get("CI"), reason="promtool not installed (scripts/setup.sh test)")
def test_promtool_check_and_unit_tests(tmp_path):
    subprocess.run(["promtool", "check", "rules", str(RULES)], check=True, capture_output=True)
    shutil.copy(RULES, tmp_path / "prometheus-rules.yaml")
    shutil.copy(Path(__file__).with_name("promtool") / "alerts_test.yaml", tmp_path / "alerts_test.yaml")
    r = subprocess.run(["promtool", "test", "rules", "alerts_test.yaml"], cwd=tmp_path, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr
