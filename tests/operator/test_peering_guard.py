"""The resync tasks' peering guard: kopf's rule (a live peer at or above our priority pauses us), read from
the peering object, and a resync task that holds its writes while another replica is active."""

from __future__ import annotations

import asyncio
import datetime
import logging
from typing import Any

import pytest

from pdcluster.operator import handlers, peering
from pdcluster.operator.kube import ApiError

NOW = datetime.datetime(2026, 12, 2, 5, 0, tzinfo=datetime.UTC)
ME = peering.Peering(name="pdc", identity="pod-a", priority=-100, clusterwide=True)


def keepalive(priority: int, seen_ago: float, lifetime: int = 60) -> dict[str, Any]:
    return {"priority": priority, "lifetime": lifetime,
            "lastseen": (NOW - datetime.timedelta(seconds=seen_ago)).isoformat()}


@pytest.mark.parametrize(("status", "expected"), [
    (None, True),
    ({}, True),
    ({"pod-a": keepalive(-100, 1)}, True),  # only ourselves
    ({"pod-b": keepalive(-50, 10)}, False),  # a live peer above us
    ({"pod-b": keepalive(-100, 10)}, False),  # the same priority: kopf pauses everyone
    ({"pod-b": keepalive(-200, 10)}, True),  # below us
    ({"pod-b": keepalive(-50, 61)}, True),  # above us but its keep-alive has lapsed
    ({"pod-b": keepalive(-50, 61, lifetime=120)}, False),  # its own, longer lifetime
    ({"pod-b": {"priority": 5, "lastseen": "yesterday"}}, True),  # not a keep-alive: ignored
    ({"pod-b": "junk", "pod-c": keepalive(-200, 1)}, True),
])
def test_may_write_follows_kopfs_rule(status: Any, expected: bool) -> None:
    assert peering.may_write(status, ME, NOW) is expected


def test_a_naive_lastseen_counts_as_utc() -> None:
    naive = (NOW - datetime.timedelta(seconds=5)).replace(tzinfo=None).isoformat()
    assert peering.may_write({"pod-b": {"priority": 0, "lifetime": 60, "lastseen": naive}}, ME, NOW) is False


class _FakeKube:
    def __init__(self) -> None:
        self.status: dict[str, Any] = {}
        self.paths: list[tuple[str, dict[str, str] | None]] = []
        self.fail = False

    async def request(self, method: str, path: str, *, params: dict[str, str] | None = None) -> dict[str, Any]:
        self.paths.append((path, params))
        if self.fail:
            raise ApiError(503, "ServiceUnavailable", "down", method, path)
        return {"items": [{"metadata": {"name": "pdc"}, "status": self.status}]}


async def test_active_reads_the_cluster_or_namespaced_peering_object() -> None:
    kube = _FakeKube()
    kube.status = {"pod-b": keepalive(0, 0)}
    kube.status["pod-b"]["lastseen"] = datetime.datetime.now(datetime.UTC).isoformat()
    assert await peering.active(kube, ME, "ns1") is False  # type: ignore[arg-type]
    namespaced = peering.Peering(name="pdc", identity="pod-a", priority=10, clusterwide=False)
    assert await peering.active(kube, namespaced, "ns1") is True  # type: ignore[arg-type]
    assert kube.paths == [("/apis/kopf.dev/v1/clusterkopfpeerings", {"fieldSelector": "metadata.name=pdc"}),
                          ("/apis/kopf.dev/v1/namespaces/ns1/kopfpeerings", {"fieldSelector": "metadata.name=pdc"})]


async def test_resync_task_holds_its_writes_while_another_replica_is_active(monkeypatch: pytest.MonkeyPatch
                                                                           ) -> None:
    kube = _FakeKube()
    passes: list[str] = []

    async def fake_reconcile(body: dict[str, Any], trigger: str, retry: int = 0) -> Any:
        passes.append(trigger)
        return type("Out", (), {"next_delay": 0.05})()

    monkeypatch.setattr(handlers, "_reconcile_locked", fake_reconcile)
    monkeypatch.setattr(handlers.RUNTIME, "kube", kube)
    monkeypatch.setattr(handlers.RUNTIME, "peering", ME)
    monkeypatch.setattr(handlers.RUNTIME, "resync_seconds", 0.05)

    def other_replica_alive() -> None:
        kube.status = {"pod-b": {"priority": 0, "lifetime": 60,
                                 "lastseen": datetime.datetime.now(datetime.UTC).isoformat()}}

    other_replica_alive()
    stop, kick = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(handlers._resync_loop("x", "ns1", stop, logging.getLogger("t"), kick, 0.05))
    try:
        await asyncio.sleep(0.4)
        assert passes == [] and len(kube.paths) >= 3  # asked each pass, wrote nothing
        kube.fail = True  # the peering object unreadable: still no write (backs off)
        await asyncio.sleep(0.2)
        assert passes == []
        kube.fail, kube.status = False, {}  # the other replica is gone: this one resumes
        kick.set()
        deadline = asyncio.get_running_loop().time() + 10
        while not passes and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        assert passes, "the resync never resumed"
    finally:
        stop.set()
        kick.set()
        await asyncio.wait_for(task, 5)
