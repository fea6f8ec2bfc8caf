"""The source of observability/grafana-dashboard.json and the chart's copy (`make generate` writes both).

The JSON is committed; this script is the readable source, so a panel change is a one-line edit here
instead of a hand-edited 1,000-line JSON. Only series of the workers and router (worker/api/metrics.py; see
docs/architecture.md), the operator (operator/opmetrics.py) and our recording rules are used (tests/bench
checks).
"""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path

SEL = 'pdcluster=~"$pdcluster"'


def ts(title: str, targets: list[tuple[str, str]], unit: str = "short", w: int = 8, desc: str = "",
       stack: bool = False, bars: bool = False) -> dict:
    """A time-series panel; targets are (PromQL, legend)."""
    return {
        "type": "timeseries",
        "title": title,
        "description": desc,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "custom": {"drawStyle": "bars" if bars else "line", "fillOpacity": 60 if bars else 10,
                           "stacking": {"mode": "normal" if stack else "none"}, "showPoints": "never"},
            },
            "overrides": [],
        },
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [{"expr": e, "legendFormat": lg, "refId": chr(65 + i)} for i, (e, lg) in enumerate(targets)],
        "_w": w,
    }


def stat(title: str, expr: str, unit: str, w: int = 4, desc: str = "", thresholds=None) -> dict:
    steps = [{"color": "green", "value": None}] + [{"color": c, "value": v} for v, c in (thresholds or [])]
    return {
        "type": "stat",
        "title": title,
        "description": desc,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": {"unit": unit, "thresholds": {"mode": "absolute", "steps": steps}},
                        "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "background", "graphMode": "area"},
        "targets": [{"expr": expr, "refId": "A", "instant": False}],
        "_w": w,
    }


def phase_mean(phase: str) -> str:
    """Mean seconds per request in one phase of pdcluster_request_phase_seconds (over every role observing it)."""
    return (f'sum(rate(pdcluster_request_phase_seconds_sum{{phase="{phase}",{SEL}}}[$__rate_interval])) / '
            f'sum(rate(pdcluster_request_phase_seconds_count{{phase="{phase}",{SEL}}}[$__rate_interval]))')


def q(hist: str, quant: float, by: str = "role") -> str:
    return f"histogram_quantile({quant}, sum by (le, {by}) (rate({hist}_bucket{{{SEL}}}[$__rate_interval])))"


ROWS: list[tuple[str, list[dict]]] = [
    ("Service level (TTFT = prefill side, TPOT = decode side)", [
        stat("TTFT SLO errors (1h)", "max(pdcluster:ttft_slo_errors:ratio_rate1h{" + SEL + "})", "percentunit",
             desc="Share of requests over 2.5 s to first token, at the router (budget 1%).",
             thresholds=[(0.01, "orange"), (0.144, "red")]),
        stat("TPOT SLO errors (1h)", "max(pdcluster:tpot_slo_errors:ratio_rate1h{" + SEL + "})", "percentunit",
             desc="Share of inter-token gaps over 100 ms, at the router (budget 1%).",
             thresholds=[(0.01, "orange"), (0.144, "red")]),
        stat("Requests/s", f'sum(rate(pdcluster_requests_total{{role="router",{SEL}}}[$__rate_interval]))', "reqps"),
        stat("Rejected/s", f"sum(rate(pdcluster_requests_rejected_total{{{SEL}}}[$__rate_interval]))", "reqps",
             thresholds=[(0.01, "orange"), (1, "red")]),
        stat("Ratio D/P", f'count(pdcluster_requests_running{{role="decode",{SEL}}}) / count(pdcluster_requests_running{{role="prefill",{SEL}}})',
             "none", desc="Decode replicas per prefill replica (reporting instances), as the Ratio column of kubectl get pdc."),
        stat("Max KV usage", f"max(pdcluster_kv_cache_usage_ratio{{{SEL}}})", "percentunit",
             thresholds=[(0.8, "orange"), (0.9, "red")]),
        ts("TTFT p50 / p99 by role", [
            (q("pdcluster_time_to_first_token_seconds", 0.5), "p50 {{role}}"),
            (q("pdcluster_time_to_first_token_seconds", 0.99), "p99 {{role}}"),
        ], "s", w=12, desc="Router = what clients see. High on prefill: prefill queue/compute; router-only gap: transfer or decode admission."),
        ts("TPOT p50 / p99 by role", [
            (q("pdcluster_time_per_output_token_seconds", 0.5), "p50 {{role}}"),
            (q("pdcluster_time_per_output_token_seconds", 0.99), "p99 {{role}}"),
        ], "s", w=12, desc="Decode's metric: batch size, KV pressure, preemptions, prefill work on decode workers."),
    ]),
    ("Request phases: where did the time go", [
        ts("Where did the TTFT go (mean per request)", [
            (phase_mean(ph), ph) for ph in ("router_queue", "prefill_queue", "prefill_compute")
        ], "s", w=12, stack=True,
           desc="TTFT = router queue (admission, tokenize, pick) + prefill queue (waiting for the engine) + prefill "
                "compute. A tall router_queue: routing/admission; prefill_queue: add prefill capacity; "
                "prefill_compute: long prompts or a slow/cold prefix cache."),
        ts("After the first token (mean per request)", [
            (phase_mean(ph), ph) for ph in ("kv_transfer", "decode_queue", "decode")
        ], "s", w=12, stack=True,
           desc="KV transfer (first token to all layers acknowledged), decode queue (KV in, waiting for a decode "
                "step), decode (first token to last)."),
        ts("End-to-end latency p50 / p99", [
            (q("pdcluster_e2e_request_latency_seconds", 0.5), "p50 {{role}}"),
            (q("pdcluster_e2e_request_latency_seconds", 0.99), "p99 {{role}}"),
        ], "s"),
        ts("Finished requests/s by reason", [
            (f"sum by (finish_reason) (rate(pdcluster_request_success_total{{role=\"router\",{SEL}}}[$__rate_interval]))",
             "{{finish_reason}}"),
        ], "reqps", desc="length: max_tokens reached; stop: EOS or a stop string; abort/error: cut short."),
        ts("Prefix-cache hit rate by role", [
            (f"sum by (role) (rate(pdcluster_prefix_cache_hit_tokens_total{{{SEL}}}[$__rate_interval])) / "
             f"sum by (role) (rate(pdcluster_prefix_cache_query_tokens_total{{{SEL}}}[$__rate_interval]))", "{{role}}"),
        ], "percentunit", desc="Prompt tokens served from the prefix cache / prompt tokens looked up. Prefix-aware "
                               "routing (router --routing prefix) raises it when prompts share prefixes."),
    ]),
    ("Throughput", [
        ts("Requests/s by role", [(f"sum by (role) (rate(pdcluster_requests_total{{{SEL}}}[$__rate_interval]))", "{{role}}")], "reqps"),
        ts("Prompt tokens/s by role", [(f"sum by (role) (rate(pdcluster_prompt_tokens_total{{{SEL}}}[$__rate_interval]))", "{{role}}")], "short"),
        ts("Generated tokens/s by role", [(f"sum by (role) (rate(pdcluster_generation_tokens_total{{{SEL}}}[$__rate_interval]))", "{{role}}")], "short"),
    ]),
    ("Queues: prefill → transfer → decode", [
        ts("Prefill queue", [
            (f'sum(pdcluster_requests_waiting{{role=~"prefill|both",{SEL}}})', "waiting"),
            (f'sum(pdcluster_requests_running{{role=~"prefill|both",{SEL}}})', "running"),
        ], "short", desc="Growing waiting = prefill under-provisioned (TTFT rises)."),
        ts("Transfer queue (KV transfers in flight)", [
            (f"sum by (role) (rate(pdcluster_kv_transfer_seconds_sum{{{SEL}}}[$__rate_interval]))", "{{role}}"),
        ], "short", desc="Little's law: transfers/s x mean transfer time = transfers in flight. Rising while both pools idle = network bound."),
        ts("Decode queue", [
            (f'sum(pdcluster_requests_waiting{{role="decode",{SEL}}})', "waiting"),
            (f'sum(pdcluster_requests_running{{role="decode",{SEL}}})', "running (batch)"),
        ], "short", desc="Waiting > 0: no KV room or batch cap reached (TTFT and TPOT rise)."),
        ts("Router queue and rejections", [
            (f'sum(pdcluster_requests_waiting{{role="router",{SEL}}})', "router waiting"),
            (f"sum by (reason) (rate(pdcluster_requests_rejected_total{{{SEL}}}[$__rate_interval]))", "rejected {{reason}}/s"),
        ], "short", w=24),
    ]),
    ("KV cache", [
        ts("KV usage by role (max / mean over pods)", [
            (f"max by (role) (pdcluster_kv_cache_usage_ratio{{{SEL}}})", "max {{role}}"),
            (f"avg by (role) (pdcluster_kv_cache_usage_ratio{{{SEL}}})", "mean {{role}}"),
        ], "percentunit"),
        ts("KV blocks used by role", [(f"sum by (role) (pdcluster_kv_cache_used_blocks{{{SEL}}})", "{{role}}")], "short"),
        ts("Preemptions/s by role", [(f"sum by (role) (rate(pdcluster_preemptions_total{{{SEL}}}[$__rate_interval]))", "{{role}}")],
           "short", desc="Non-zero with usage > 90%: decode is out of KV memory (TPOT stalls)."),
    ]),
    ("KV transfer", [
        ts("Transfer bandwidth by role", [(f"sum by (role) (rate(pdcluster_kv_transfer_bytes_total{{{SEL}}}[$__rate_interval]))", "{{role}}")], "Bps"),
        ts("Transfer latency", [
            (q("pdcluster_kv_transfer_seconds", 0.5), "p50 {{role}}"),
            (q("pdcluster_kv_transfer_seconds", 0.99), "p99 {{role}}"),
        ], "s"),
        ts("Transfer failures/s", [(f"sum by (role) (rate(pdcluster_kv_transfer_failures_total{{{SEL}}}[$__rate_interval]))", "{{role}}")], "short"),
    ]),
    ("Scaling (operator)", [
        ts("Replicas: serving vs desired", [
            (f'count by (role) (pdcluster_requests_running{{role=~"prefill|decode|both",{SEL}}})', "serving {{role}}"),
            (f'max by (role) (pdcluster_autoscaler_desired_replicas{{{SEL}}})', "desired {{role}}"),
        ], "short", desc="Desired above serving for long = ScalingLimited (pending pods, maxReplicas)."),
        ts("Ratio D/P (decode per prefill replica)", [
            (f'count(pdcluster_requests_running{{role="decode",{SEL}}}) / count(pdcluster_requests_running{{role="prefill",{SEL}}})', "serving"),
            (f'max(pdcluster_autoscaler_desired_replicas{{role="decode",{SEL}}}) / max(pdcluster_autoscaler_desired_replicas{{role="prefill",{SEL}}})', "desired"),
        ], "none", desc="Same convention as status.ratio / the Ratio column of kubectl get pdc."),
        ts("Autoscaler decisions by reason", [
            (f"sum by (reason) (increase(pdcluster_autoscaler_decisions_total{{{SEL}}}[$__rate_interval]))", "{{reason}}"),
        ], "short", bars=True, stack=True, desc="Each decision of the autoscaler (ScaleUp, ScaleDown, Steady, Stabilizing, CapacityUnknown, ...)."),
        ts("Scaling steps by cause", [
            (f"sum by (role, cause) (increase(pdcluster_autoscaler_scaling_steps_total{{{SEL}}}[$__rate_interval]))",
             "{{role}} {{cause}}"),
        ], "short", bars=True, stack=True, desc="Each pool size change and the rule that set it: formula, burst, "
           "slo-guard, bound, stabilization, limit (docs/runbooks/AutoscalerDecisions.md)."),
        ts("Learned capacity per instance", [
            (f"max by (role) (pdcluster_autoscaler_learned_capacity_tokens_per_second{{{SEL}}})", "{{role}}"),
        ], "short", w=12, desc="Prompt tok/s (prefill) and output tok/s (decode) per instance, as learned; compare with `pdcluster profile`."),
        ts("Operator reconciles and errors", [
            ("sum by (result) (rate(pdcluster_operator_reconciles_total[$__rate_interval]))", "reconcile {{result}}"),
            ("sum by (kind) (rate(pdcluster_operator_errors_total[$__rate_interval]))", "error {{kind}}"),
        ], "short", w=12),
    ]),
]


def build() -> dict:
    panels, y = [], 0
    _next_id = itertools.count(1)
    for title, row in copy.deepcopy(ROWS):
        panels.append({"type": "row", "title": title, "id": next(_next_id), "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        y += 1
        x, h_row = 0, 0
        for p in row:
            w = p.pop("_w")
            h = 4 if p["type"] == "stat" else 8
            if x + w > 24:
                x, y = 0, y + h_row
                h_row = 0
            p["id"] = next(_next_id)
            p["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
            panels.append(p)
            x += w
            h_row = max(h_row, h)
        y += h_row
    return {
        "title": "pdcluster",
        "uid": "pdcluster-overview",
        "description": "Prefill/decode-disaggregated inference: SLOs, queues, KV cache, transfers, scaling. Runbooks: docs/runbooks/.",
        "tags": ["pdcluster", "llm", "inference"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-3h", "to": "now"},
        "refresh": "30s",
        "timezone": "utc",
        "graphTooltip": 1,
        "annotations": {"list": [{
            "name": "Autoscaler scale events", "enable": True, "iconColor": "orange",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "expr": f'sum by (reason) (increase(pdcluster_autoscaler_decisions_total{{reason=~"ScaleUp|ScaleDown|Rebalance",{SEL}}}[2m])) > 0',
            "titleFormat": "{{reason}}", "step": "60s",
        }]},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus",
             "current": {}, "hide": 0},
            {"name": "pdcluster", "type": "query", "label": "PDCluster",
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": "label_values(pdcluster_requests_total, pdcluster)", "refId": "PDClusterVar"},
             "definition": "label_values(pdcluster_requests_total, pdcluster)",
             # ".*" also matches series without the label (e.g. `pdcluster up` on a laptop)
             "includeAll": True, "allValue": ".*", "multi": True, "refresh": 2, "current": {}, "hide": 0},
        ]},
        "panels": panels,
    }


if __name__ == "__main__":
    out = Path(__file__).with_name("grafana-dashboard.json")
    out.write_text(json.dumps(build(), indent=1) + "\n")
    print(f"wrote {out}")
