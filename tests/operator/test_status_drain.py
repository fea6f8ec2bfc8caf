"""Pure helpers: conditions keep lastTransitionTime, rollout state, victim choice, the operator CLI parser."""

from __future__ import annotations

import argparse

import pytest

from pdcluster.operator import cli, drain
from pdcluster.operator import status as st


def test_last_transition_time_is_kept_while_status_is_unchanged() -> None:
    c1 = st.merge_conditions(None, [st.condition("Ready", False, "PoolsNotReady", "0/1")], "T1", 1)
    assert c1[0]["lastTransitionTime"] == "T1" and c1[0]["observedGeneration"] == 1
    c2 = st.merge_conditions(c1, [st.condition("Ready", False, "PoolsNotReady", "0/2")], "T2", 2)
    assert c2[0]["lastTransitionTime"] == "T1" and c2[0]["message"] == "0/2" and c2[0]["observedGeneration"] == 2
    c3 = st.merge_conditions(c2, [st.condition("Ready", True, "AllPoolsReady", "ok")], "T3", 2)
    assert c3[0]["lastTransitionTime"] == "T3"
    # conditions not recomputed in a pass are kept, in a fixed order
    c4 = st.merge_conditions(c3, [st.condition("Degraded", False, "Reconciled", "")], "T4", 2)
    assert [c["type"] for c in c4] == ["Ready", "Degraded"] and c4[0]["lastTransitionTime"] == "T3"


def _dep(want, ready, updated=None, gen=1, observed=1, failed=False):
    conds = [{"type": "Progressing", "reason": "ProgressDeadlineExceeded", "message": "stuck"}] if failed else []
    return {"metadata": {"generation": gen}, "spec": {"replicas": want},
            "status": {"observedGeneration": observed, "replicas": want, "readyReplicas": ready,
                       "updatedReplicas": want if updated is None else updated, "conditions": conds}}


def test_rollout_state_and_workload_conditions() -> None:
    assert st.rollout_state(_dep(2, 2))[:2] == (False, False)
    assert st.rollout_state(_dep(2, 1))[:2] == (True, False)
    assert st.rollout_state(_dep(2, 2, gen=2, observed=1))[:2] == (True, False)
    assert st.rollout_state(_dep(2, 0, failed=True))[:2] == (True, True)
    conds = {c["type"]: c for c in st.workload_conditions(
        {"prefill": _dep(1, 1), "decode": _dep(2, 2), "router": _dep(1, 1)})}
    assert conds["Ready"]["status"] == "True" and conds["Progressing"]["status"] == "False"
    conds = {c["type"]: c for c in st.workload_conditions(
        {"prefill": _dep(1, 0, failed=True), "decode": _dep(2, 2), "router": None})}
    assert conds["Ready"]["status"] == "False" and conds["Degraded"]["reason"] == "RolloutFailed"
    assert st.ratio(13, 16) == 1.231 and st.ratio(0, 3) is None


def _pod(name, created, ready=True, node="n1", draining=False, deleting=False):
    meta = {"name": name, "creationTimestamp": created, "annotations": {}}
    if draining:
        meta["annotations"][drain.DRAINING] = "t"
    if deleting:
        meta["deletionTimestamp"] = "t"
    return {"metadata": meta, "spec": {"nodeName": node} if node else {},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_victims_prefer_draining_then_unscheduled_unready_and_young() -> None:
    pods = [
        _pod("old", "2026-01-01T00:00:00Z"),
        _pod("young", "2026-01-03T00:00:00Z"),
        _pod("mid", "2026-01-02T00:00:00Z"),
        _pod("unready", "2026-01-01T00:00:00Z", ready=False),
        _pod("pending", "2026-01-01T00:00:00Z", ready=False, node=None),
        _pod("marked", "2026-01-01T00:00:00Z", draining=True),
        _pod("going", "2026-01-04T00:00:00Z", deleting=True),
    ]
    names = [p["metadata"]["name"] for p in drain.pick_victims(pods, 6)]
    assert names == ["marked", "pending", "unready", "young", "mid", "old"]
    assert drain.pick_victims(pods, 0) == []


def test_operator_cli_parser() -> None:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    a = p.parse_args([])
    assert a.namespace == [] and a.peering is None and a.metrics_port == 8080 and a.resync_seconds == 60
    assert a.metrics_address == "0.0.0.0"
    assert p.parse_args(["--metrics-address", "127.0.0.1"]).metrics_address == "127.0.0.1"
    a = p.parse_args(["-n", "a", "--namespace", "b", "--peering", "x", "--resync-seconds", "5"])
    assert a.namespace == ["a", "b"] and a.peering == "x" and a.resync_seconds == 5
    with pytest.raises(SystemExit):  # refused by the parser (tests/operator/test_cli_flags.py)
        p.parse_args(["--resync-seconds", "0", "--metrics-port", "0"])


def test_operator_metrics_address_that_cannot_be_bound_is_a_one_line_error(capsys) -> None:
    import socket

    with socket.socket() as s:  # a free port, so only the address can be the problem
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    # 203.0.113.0/24 is TEST-NET-3: never a local address
    assert cli.run(p.parse_args(["--metrics-port", str(port), "--metrics-address", "203.0.113.7"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot serve metrics on 203.0.113.7" in err[0]
