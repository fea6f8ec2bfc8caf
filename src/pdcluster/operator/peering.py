"""Is this replica the active one? kopf's peering rule, read by the operator's own resync tasks.

kopf pauses its watchers on a standby replica, but the per-PDCluster resync tasks are ours (see handlers):
a replica that was active for a while (the old active's keep-alives lapsed) and then sees the old one
again would keep resyncing next to it — two writers. So each resync pass first asks the peering object
whether this replica may write, by the rule kopf applies (kopf/_core/engines/peering.py): a replica runs
while no live peer has a higher priority, and every replica pauses while a live peer shares its priority.
A peer is live until `lastseen + lifetime`.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from typing import Any

from pdcluster.operator.kube import Kube, resource_path

GROUP_VERSION = "kopf.dev/v1"


@dataclasses.dataclass(frozen=True)
class Peering:
    name: str
    identity: str  # as kopf writes it in the peering object's status (POD_ID in a pod)
    priority: int
    clusterwide: bool  # ClusterKopfPeering; else a KopfPeering in each watched namespace


def _deadline(info: Mapping[str, Any]) -> datetime.datetime | None:
    try:
        seen = datetime.datetime.fromisoformat(str(info["lastseen"]))
        lifetime = datetime.timedelta(seconds=int(info.get("lifetime", 60)))
    except (KeyError, TypeError, ValueError):
        return None  # not a keep-alive kopf wrote: ignore it rather than pause on it
    if seen.tzinfo is None:
        seen = seen.replace(tzinfo=datetime.UTC)
    return seen + lifetime


def may_write(status: Mapping[str, Any] | None, me: Peering, now: datetime.datetime) -> bool:
    """True unless a live peer other than `me` has a priority at or above ours."""
    for identity, info in (status or {}).items():
        if identity == me.identity or not isinstance(info, Mapping):
            continue
        deadline = _deadline(info)
        if deadline is None or deadline <= now:
            continue
        try:
            priority = int(info.get("priority", 0))
        except (TypeError, ValueError):
            continue
        if priority >= me.priority:
            return False
    return True


async def active(kube: Kube, me: Peering, namespace: str) -> bool:
    """Read the peering object (list + field selector: the chart's peering role grants list, not get)."""
    plural, ns = ("clusterkopfpeerings", None) if me.clusterwide else ("kopfpeerings", namespace)
    res = await kube.request("GET", resource_path(GROUP_VERSION, plural, ns),
                             params={"fieldSelector": f"metadata.name={me.name}"})
    items = res.get("items") or []
    status = items[0].get("status") if items else None
    return may_write(status, me, datetime.datetime.now(datetime.UTC))
