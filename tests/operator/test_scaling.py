"""The scaling step (`operator/scaling.py`) and the one replica clamp (`planner.clamp_replicas`)."""

from __future__ import annotations

from typing import Any

import pytest

from pdcluster.operator import autoscaler as asc
from pdcluster.operator import reconcile as rec
from pdcluster.operator import scaling
from pdcluster.operator import status as st
from pdcluster.operator.models import parse_spec
from pdcluster.operator.planner import Bounds, clamp_pair, clamp_replicas

from .conftest import make_body, make_spec
from .test_deletion import FakeKube, _ctx

NOW = 1_700_000_000.0
CAPACITY = {"prefillTokensPerSecond": 10000, "decodeTokensPerSecond": 2000}


def auto_spec(**autoscaling: Any) -> Any:
    return parse_spec(make_spec(autoscaling={"enabled": True, "prometheusUrl": "http://prom:9090",
                                             "capacity": CAPACITY, **autoscaling}))


class FixedSource:
    def __init__(self, obs: asc.Observation | None) -> None:
        self.obs, self.calls = obs, 0

    def observe(self, cluster: str, window_seconds: int, ready: dict[str, int] | None = None,
                **_: object) -> asc.Observation:
        self.calls += 1
        if self.obs is None:
            raise RuntimeError("down")
        return self.obs


def pools(p: int | None, d: int | None, ready: tuple[int, int] | None = None) -> scaling.Pools:
    r = ready or (p or 0, d or 0)
    return scaling.Pools(current={"prefill": p, "decode": d}, ready={"prefill": r[0], "decode": r[1]},
                         created={"prefill": NOW - 3600, "decode": NOW - 3600})


# ---- the clamp ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,lo,hi,want", [(0, 1, 4, 1), (9, 1, 4, 4), (3, 1, 4, 3), (50, 2, None, 50),
                                          (5, 3, 2, 3)])  # crossed bounds (schema forbids): the minimum wins
def test_clamp_replicas(n: int, lo: int, hi: int | None, want: int) -> None:
    assert clamp_replicas(n, lo, hi) == want


def test_bounds_clamp_per_role_and_clamp_pair_agree() -> None:
    b = Bounds(min_prefill=2, max_prefill=4, min_decode=1, max_decode=None)
    assert (b.clamp("prefill", 9), b.clamp("decode", 90), b.clamp("prefill", 0)) == (4, 90, 2)
    assert clamp_pair(9, 0, b) == (4, 1, ["min-decode", "max-prefill"])
    with pytest.raises(ValueError):
        b.of("router")


# ---- the step ----------------------------------------------------------------------------------------

async def test_disabled_uses_the_spec_replicas() -> None:
    spec = parse_spec(make_spec())
    s = await scaling.step(spec, {}, pools(None, None), NOW, cluster="demo", source_for=lambda u: FixedSource(None),
                           resync_seconds=60)
    assert s.desired == {"prefill": 1, "decode": 2} and s.decision is None and s.autoscaler_status == {}
    assert [c["reason"] for c in s.conditions] == ["AutoscalingDisabled"] * 4


def test_base_starts_from_the_recorded_desired_count_within_the_current_bounds() -> None:
    spec = auto_spec()  # prefill max 4, decode max 8
    old = {"prefill": {"desiredReplicas": 3}, "decode": {"desiredReplicas": 20}}
    assert scaling.base_replicas(spec, old, {"prefill": 1, "decode": 1}) == {"prefill": 3, "decode": 8}
    assert scaling.base_replicas(spec, {}, {"prefill": None, "decode": 5}) == {"prefill": 1, "decode": 5}


async def test_not_due_holds_and_wakes_at_the_end_of_the_interval() -> None:
    spec = auto_spec(intervalSeconds=30, flipWindowSeconds=0)  # without the short-window flip step
    source = FixedSource(asc.Observation(10.0, 1000.0, 100.0))
    old = {"prefill": {"desiredReplicas": 2}, "decode": {"desiredReplicas": 3},
           "autoscaler": {"lastEvaluationTime": st.fmt_time(NOW - 10), "reason": "Steady"}}
    s = await scaling.step(spec, old, pools(2, 3), NOW, cluster="demo", source_for=lambda u: source,
                           resync_seconds=60)
    assert source.calls == 0 and s.decision is None
    assert s.desired == {"prefill": 2, "decode": 3} and s.next_delay == pytest.approx(20)
    assert s.autoscaler_status == old["autoscaler"]


async def test_due_evaluates_records_state_and_asks_for_a_scaled_event() -> None:
    spec = auto_spec(flipWindowSeconds=0)  # the short-window flip step: test_autoscaler_flip_window.py
    # 10 req/s x 2000 in / 10000 -> 1.5*2 = 3 prefill; 10 x 400 out / 2000 -> 1.5*2 = 3 decode
    source = FixedSource(asc.Observation(10.0, 2000.0, 400.0))
    s = await scaling.step(spec, {}, pools(1, 2), NOW, cluster="demo", source_for=lambda u: source,
                           resync_seconds=60)
    assert source.calls == 1 and s.decision is not None and s.decision.reason == asc.SCALE_UP
    assert s.desired == {"prefill": 3, "decode": 3}
    # each pool's step carries its cause (autoscaler_explain): here the formula at the mean rate
    assert s.scaled_message and s.scaled_message.startswith("prefill 1->3 (formula), decode 2->3 (formula) (ScaleUp")
    assert s.autoscaler_status["lastEvaluationTime"] == st.fmt_time(NOW)
    last = s.autoscaler_status["lastDecision"]
    assert last["prefill"]["desired"] == 3 and last["prefill"]["cause"] == "formula"
    assert last["message"] == "prefill 1->3 (formula), decode 2->3 (formula): ScaleUp"
    assert {c["type"]: c["status"] for c in s.conditions} == {"MetricsAvailable": "True", "ScalingLimited": "False",
                                                              "SLOMet": "Unknown", "KVTransferDegraded": "Unknown"}
    assert s.next_delay == spec.autoscaling.intervalSeconds


async def test_unreachable_metrics_hold_and_say_why() -> None:
    s = await scaling.step(auto_spec(), {}, pools(2, 2), NOW, cluster="demo",
                           source_for=lambda u: FixedSource(None), resync_seconds=60)
    assert s.desired == {"prefill": 2, "decode": 2} and s.scaled_message is None
    (metrics, _, _, transfer) = s.conditions
    assert (transfer["type"], transfer["status"]) == ("KVTransferDegraded", "Unknown")
    assert (metrics["status"], metrics["reason"]) == ("False", "PrometheusUnreachable")


# ---- status.autoscaler is hand-editable JSON ---------------------------------------------------------

def test_autoscaler_state_ignores_timestamps_that_are_not_strings() -> None:
    # Regression: a number where a timestamp belongs raised AttributeError (parse_time called .replace).
    state = st.autoscaler_state({"lastScaleTime": {"prefill": 5, "decode": "2026-01-01T00:00:00Z"},
                                 "stabilization": {"prefill": {"belowSince": True, "maxNeed": 2.0}}})
    assert state.prefill.last_change is None and state.prefill.below_since is None
    assert state.decode.last_change == st.parse_time("2026-01-01T00:00:00Z")


async def test_reconcile_survives_a_numeric_last_evaluation_time() -> None:
    # Regression: status.autoscaler.lastEvaluationTime: 12345 crashed every reconcile pass.
    spec = make_spec(autoscaling={"enabled": True, "prometheusUrl": "http://prom:9090", "capacity": CAPACITY})
    body = make_body(name="edited", spec=spec, status={"autoscaler": {"lastEvaluationTime": 12345}})
    ctx = _ctx(FakeKube(), [])
    ctx.source_for = lambda url: FixedSource(asc.Observation(0.0, None, None))
    out = await rec.reconcile(ctx, body, "resync")
    assert out.decision is not None  # treated as never evaluated: evaluated now
    assert out.status["autoscaler"]["lastEvaluationTime"] != 12345


async def test_slo_guard_is_asked_for_the_percentile_and_reported_in_a_condition() -> None:
    spec = auto_spec(slo={"ttftSeconds": 2.0, "percentile": 0.95})
    asked: dict[str, Any] = {}

    class Source(FixedSource):
        def observe(self, cluster, window_seconds, ready=None, **kw):  # type: ignore[override]
            asked.update(kw)
            return super().observe(cluster, window_seconds, ready)

    # 10 req/s x 2000 / 10000 x 1.5 = 3 prefill: enough by the formula, but TTFT p95 is 6 s with a queue
    o = asc.Observation(10.0, 2000.0, 400.0, ttft_seconds=6.0, prefill_queue_mean=4.0)
    s = await scaling.step(spec, {}, pools(3, 3), NOW, cluster="demo", source_for=lambda u: Source(o),
                           resync_seconds=60)
    assert asked == {"percentile": 0.95, "burst_seconds": 10}
    assert s.desired["prefill"] == 4 and s.decision is not None and s.decision.reason == asc.SLO_GUARD
    slo = next(c for c in s.conditions if c["type"] == "SLOMet")
    assert (slo["status"], slo["reason"]) == ("False", "SLOBreached") and "TTFT p95 6 s > 2 s" in slo["message"]
    assert s.autoscaler_status["slo"]["prefill"] == {"capacityScale": 0.85, "breaches": 1}
    assert scaling.WARN_WHEN["SLOMet"] == ("False", "SLOBreached")
    # without targets the percentile is not asked for, and SLOMet is Unknown
    asked.clear()
    s = await scaling.step(auto_spec(), {}, pools(3, 3), NOW, cluster="demo",
                           source_for=lambda u: Source(asc.Observation(10.0, 2000.0, 400.0)), resync_seconds=60)
    assert asked["percentile"] is None
    assert next(c for c in s.conditions if c["type"] == "SLOMet")["status"] == "Unknown"


async def test_slo_guard_metrics_are_exported() -> None:
    from pdcluster.operator import naming, opmetrics

    spec = auto_spec(slo={"ttftSeconds": 2.0})
    o = asc.Observation(10.0, 2000.0, 400.0, ttft_seconds=6.0, prefill_queue_mean=4.0)
    s = await scaling.step(spec, {}, pools(3, 3), NOW, cluster="sloguard", source_for=lambda u: FixedSource(o),
                           resync_seconds=60)
    scaling.record_metrics(naming.Owner("sloguard", "ns", "uid"), spec, s)
    reg = opmetrics.REGISTRY
    labels = {"namespace": "ns", "pdcluster": "sloguard", "role": "prefill"}
    assert reg.get_sample_value("pdcluster_autoscaler_slo_scale_ups_total", labels) == 1.0
    assert reg.get_sample_value("pdcluster_autoscaler_capacity_scale", labels) == pytest.approx(0.85)
    assert reg.get_sample_value("pdcluster_autoscaler_capacity_scale", {**labels, "role": "decode"}) == 1.0
