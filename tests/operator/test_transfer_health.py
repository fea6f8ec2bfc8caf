"""KVTransferDegraded: failed KV transfers (decode never got the prompt's KV) are a condition, not a silent
slowdown."""

from __future__ import annotations

from pdcluster.operator import autoscaler as asc
from pdcluster.operator import scaling
from pdcluster.operator import transfer_health as th


def obs(ok, failed) -> asc.Observation:
    return asc.Observation(5.0, 2000.0, 400.0, kv_transfers_per_second=ok, kv_transfer_failures_per_second=failed)


def test_more_than_one_percent_failing_is_degraded():
    c = th.condition(obs(9.5, 0.5))  # 5 % of 10/s
    assert (c["type"], c["status"], c["reason"]) == ("KVTransferDegraded", "True", "TransfersFailing")
    assert "5.0 % of KV transfers failed" in c["message"] and "prefilled them again" in c["message"]
    assert th.condition(obs(999.0, 1.0))["status"] == "False"  # 0.1 %: healthy
    assert scaling.WARN_WHEN["KVTransferDegraded"] == ("True", "KVTransferDegraded")  # a Warning Event on entry


def test_no_transfers_missing_series_and_no_metrics():
    assert th.condition(obs(0.0, 0.0))["reason"] == "NoTransfers"
    # the failure counter appears with the first failure: transfers alone are healthy
    c = th.condition(obs(4.0, None))
    assert (c["status"], c["reason"]) == ("False", "TransfersHealthy")
    assert th.condition(obs(None, None))["status"] == "Unknown"
    assert th.condition(None)["reason"] == "MetricsUnavailable"
    assert th.failure_share(float("nan"), 1.0) is None and th.failure_share(0.0, 2.0) == 1.0


async def test_the_scaling_step_reports_it():
    class Source:
        def observe(self, cluster, window_seconds, ready=None, *, percentile=None, burst_seconds=0):
            return obs(8.0, 2.0)

    from .test_scaling import NOW, auto_spec, pools

    s = await scaling.step(auto_spec(), {}, pools(1, 1), NOW, cluster="demo", source_for=lambda u: Source(),
                           resync_seconds=60)
    c = next(c for c in s.conditions if c["type"] == "KVTransferDegraded")
    assert c["status"] == "True" and "20.0 %" in c["message"]
