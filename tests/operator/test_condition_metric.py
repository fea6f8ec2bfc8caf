"""`pdcluster_operator_condition`: after a reconcile, every status condition written to the PDCluster is
exported as a gauge (1 on the current status, 0 on the other two), and the series go with the PDCluster."""

from __future__ import annotations

import logging

from pdcluster.operator import autoscaler as asc
from pdcluster.operator import handlers, opmetrics
from pdcluster.operator import reconcile as rec

from .conftest import make_body, make_spec
from .test_deletion import FakeKube, _ctx

STATUSES = ("True", "False", "Unknown")


def gauge(name: str, condition: str, status: str, namespace: str = "ns1") -> float | None:
    return opmetrics.REGISTRY.get_sample_value("pdcluster_operator_condition", {
        "pdcluster": name, "namespace": namespace, "condition": condition, "status": status})


def exported(name: str, namespace: str = "ns1") -> dict[str, str]:
    """condition -> the status whose series is 1; asserts the other two are 0."""
    out = {}
    for fam in opmetrics.REGISTRY.collect():
        for s in fam.samples:
            if s.name == "pdcluster_operator_condition" and s.labels["pdcluster"] == name \
                    and s.labels["namespace"] == namespace:
                assert s.value in (0.0, 1.0), s
                if s.value == 1.0:
                    assert s.labels["condition"] not in out, s
                    out[s.labels["condition"]] = s.labels["status"]
    for cond in out:
        assert [gauge(name, cond, st, namespace) for st in STATUSES].count(0.0) == 2, cond
    return out


def written(out: rec.Outcome) -> dict[str, str]:
    return {c["type"]: c["status"] for c in out.status["conditions"]}


class BusySource:
    """Far more traffic than maxReplicas can serve: the autoscaler is pinned at the bounds."""

    def observe(self, cluster: str, window_seconds: int, ready: dict[str, int] | None = None,
                **_: object) -> asc.Observation:
        return asc.Observation(request_rate=100.0, mean_input_tokens=1000.0, mean_output_tokens=200.0)


async def test_conditions_of_a_static_pdcluster_are_exported() -> None:
    out = await rec.reconcile(_ctx(FakeKube(), []), make_body(name="static"), "create")
    assert exported("static") == written(out)
    assert exported("static") == {"Ready": "False", "Progressing": "True", "Degraded": "False",
                                  "MetricsAvailable": "Unknown", "ScalingLimited": "False",
                                  "SLOMet": "Unknown", "KVTransferDegraded": "Unknown", "RoleFlips": "True"}
    assert gauge("static", "MetricsAvailable", "Unknown") == 1.0
    assert gauge("static", "MetricsAvailable", "True") == 0.0
    assert gauge("static", "MetricsAvailable", "False") == 0.0


async def test_scaling_limited_true_is_exported() -> None:
    spec = make_spec(autoscaling={"enabled": True, "prometheusUrl": "http://prom:9090",
                                  "capacity": {"prefillTokensPerSecond": 10000, "decodeTokensPerSecond": 2000}})
    ctx = _ctx(FakeKube(), [])
    ctx.source_for = lambda url: BusySource()
    out = await rec.reconcile(ctx, make_body(name="busy", spec=spec), "create")
    assert written(out)["ScalingLimited"] == "True"
    assert exported("busy") == written(out)
    assert gauge("busy", "ScalingLimited", "True") == 1.0
    assert gauge("busy", "ScalingLimited", "False") == 0.0
    assert gauge("busy", "MetricsAvailable", "True") == 1.0


async def test_degraded_is_exported_and_follows_the_next_reconcile() -> None:
    ctx = _ctx(FakeKube(), [])
    bad = make_body(name="flaky", spec=make_spec(model={"name": "tiny", "uri": "ftp://nowhere/tiny"}))
    out = await rec.reconcile(ctx, bad, "create")
    assert out.degraded
    assert gauge("flaky", "Degraded", "True") == 1.0 and gauge("flaky", "Degraded", "False") == 0.0
    assert exported("flaky") == written(out) == {"Ready": "False", "Degraded": "True"}
    # Fixed: the same series flip, nothing is left at 1 for the old status.
    fixed = make_body(name="flaky", generation=2, status=out.status)
    out = await rec.reconcile(ctx, fixed, "update")
    assert out.degraded is None
    assert gauge("flaky", "Degraded", "True") == 0.0 and gauge("flaky", "Degraded", "False") == 1.0
    assert exported("flaky") == written(out)


async def test_series_of_a_deleted_pdcluster_are_removed() -> None:
    ctx = _ctx(FakeKube(), [])
    await rec.reconcile(ctx, make_body(name="gone"), "create")
    await rec.reconcile(ctx, make_body(name="kept"), "create")
    assert exported("gone") and exported("kept")
    # Marked for deletion: the reconcile skips it and drops its series.
    deleting = make_body(name="gone")
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:05:00Z"
    out = await rec.reconcile(ctx, deleting, "resync")
    assert out.skipped == "deleting"
    assert exported("gone") == {} and gauge("gone", "Ready", "False") is None
    assert exported("kept")  # other PDClusters keep theirs
    # The watch's DELETED event drops them too (e.g. deleted without a deletionTimestamp ever being seen).
    await handlers.track_pdcluster(type="DELETED", body=make_body(name="kept"), name="kept",  # type: ignore[arg-type]
                                   namespace="ns1", logger=logging.getLogger("test"))
    assert exported("kept") == {}


def test_forgetting_an_unknown_pdcluster_is_harmless() -> None:
    opmetrics.forget_conditions("nowhere", "never-existed")
    opmetrics.set_conditions("ns9", "partial", [{"type": "Ready", "status": "True"}])
    opmetrics.forget_conditions("ns9", "partial")
    assert exported("partial", "ns9") == {}


