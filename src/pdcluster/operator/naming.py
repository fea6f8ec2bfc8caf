"""Who a PDCluster's children are: the owner identity, child names, labels, owner references, URLs.

Pure and tiny on purpose: the reconciler, the drain logic and the tests all address children through these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdcluster.operator import models
from pdcluster.operator.models import WORKER_PORT

WORKER_ROLES = ("prefill", "decode")
# The operator's own pods: the NetworkPolicy lets them reach workers for POST /drain.
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "pdcluster-operator"}


@dataclass(frozen=True)
class Owner:
    name: str
    namespace: str
    uid: str
    api_version: str = f"{models.API_GROUP}/{models.API_VERSION}"
    kind: str = models.KIND

    @classmethod
    def from_body(cls, body: Any) -> Owner:
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta.get("namespace") or "default", uid=meta.get("uid", ""))


# ---- names and labels ------------------------------------------------------------------------------

def child_name(owner: Owner | str, role: str) -> str:
    name = owner.name if isinstance(owner, Owner) else owner
    return f"{name}-{role}"


def config_map_name(owner: Owner) -> str:
    return f"{owner.name}-config"


def secret_name(owner: Owner) -> str:
    return f"{owner.name}-kv-secret"


def network_policy_name(owner: Owner) -> str:
    return f"{owner.name}-workers"


INSTANCE_LABEL = "app.kubernetes.io/instance"
NAME_LABEL = "app.kubernetes.io/name"
ROLE_LABEL = "pdcluster.dev/role"
# Every child of every PDCluster carries these: the operator watches its children by them.
CHILD_LABELS = {NAME_LABEL: "pdcluster", "app.kubernetes.io/managed-by": "pdcluster-operator"}


def instance_labels(owner: Owner) -> dict[str, str]:
    return {INSTANCE_LABEL: owner.name, **CHILD_LABELS}


def selector_labels(owner: Owner, role: str) -> dict[str, str]:
    return {INSTANCE_LABEL: owner.name, NAME_LABEL: CHILD_LABELS[NAME_LABEL], ROLE_LABEL: role}


def role_labels(owner: Owner, role: str) -> dict[str, str]:
    return {**instance_labels(owner), ROLE_LABEL: role, "app.kubernetes.io/component": role}


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": owner.api_version,
        "kind": owner.kind,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def meta(owner: Owner, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": owner.namespace, "labels": dict(labels),
            "ownerReferences": [owner_reference(owner)]}


def service_url(owner: Owner, role: str) -> str:
    return f"http://{child_name(owner, role)}.{owner.namespace}.svc:{WORKER_PORT}"


def endpoint(owner: Owner) -> str:
    return service_url(owner, "router")
