"""Issue 37 item 3, the operator's side: role flips carried out on pods (`spec.roleFlips`, on by default;
test_flip_default.py covers the default and why flips are off). The pure rules
(how many flips, what the Deployments run, which pods, the relabel), the autoscaler's flip as cause `flip`,
and a reconcile pass against a recording Kubernetes API with a real worker (tiny model) behind the pod:
the worker is asked, the pod relabelled and owned by the PDCluster, the Deployments sized so no ReplicaSet
replaces it, the flip's Event emitted; flipped pods go first when their pool shrinks."""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdcluster.operator import autoscaler as asc
from pdcluster.operator import autoscaler_explain as explain
from pdcluster.operator import autoscaler_flip as aflip
from pdcluster.operator import flips, naming, opmetrics
from pdcluster.operator import reconcile as rec
from pdcluster.operator import status as st
from pdcluster.operator.models import parse_spec

from ..disagg.harness import make_worker, serve
from .conftest import make_body, make_spec
from .test_autoscaler_guards import obs, policy

KEY = b"k" * 32
OWNER = naming.Owner("demo", "ns1", "uid-demo")


def spec(**kw: Any) -> Any:
    return parse_spec(make_spec(roleFlips=True, **kw))


def pod(name: str, role: str, *, ready: bool = True, ip: str | None = "10.0.0.1", port: int = 8000,
        flipped_from: str | None = None, draining: bool = False) -> dict[str, Any]:
    labels = {**naming.role_labels(OWNER, role), "pod-template-hash": f"h-{role}"}
    if flipped_from:
        labels[flips.FLIPPED] = flipped_from
    return {"metadata": {"name": name, "namespace": "ns1", "labels": labels,
                         "annotations": {"pdcluster.dev/draining": "x"} if draining else {},
                         "ownerReferences": [{"kind": "ReplicaSet", "name": f"demo-{role}-h", "controller": True}]},
            "spec": {"containers": [{"name": "worker", "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


# ------------------------------------------------------------------ pure rules
def test_flips_need_the_switch_the_engine_and_one_layout() -> None:
    assert flips.incompatible(spec()) is None
    assert "roleFlips" in (flips.incompatible(parse_spec(make_spec(roleFlips=False))) or "")
    assert "tensorParallelSize" in (flips.incompatible(spec(decode={"replicas": 1, "tensorParallelSize": 2})) or "")
    assert "resources" in (flips.incompatible(spec(decode={"replicas": 1, "resources": {
        "requests": {"cpu": "3"}}})) or "")


def test_how_many_flips_a_pass_makes() -> None:
    s = spec()
    assert flips.order(s, {"prefill": 3, "decode": 1}, {"prefill": 2, "decode": 2}) == flips.Order("prefill", "decode", 1)
    # grows by 3, the other gives up 1: one flip, two pods start
    assert flips.order(s, {"prefill": 2, "decode": 1}, {"prefill": 1, "decode": 4}) == flips.Order("prefill", "decode", 1)
    assert flips.order(s, {"prefill": 1, "decode": 3}, {"prefill": 3, "decode": 1}) == flips.Order("decode", "prefill", 2)
    assert flips.order(s, {"prefill": 1, "decode": 1}, {"prefill": 2, "decode": 2}) is None  # both grow
    assert flips.order(s, {"prefill": None, "decode": 1}, {"prefill": 0, "decode": 2}) is None  # nothing runs yet
    off = parse_spec(make_spec(roleFlips=False))
    assert flips.order(off, {"prefill": 3, "decode": 1}, {"prefill": 2, "decode": 2}) is None


def test_failed_flips_start_pods_and_the_source_keeps_what_it_did_not_give() -> None:
    o = flips.Order("prefill", "decode", 2)
    cur = {"prefill": 4, "decode": 1}
    planned = {"prefill": 2, "decode": 3}
    assert flips.settle(planned, cur, o, 2, 4) == planned
    # the autoscaler wanted prefill at 4 (held by stabilization): only the flip that happened leaves it
    assert flips.settle(planned, cur, o, 1, 4) == {"prefill": 3, "decode": 3}
    # ... it wanted 2 anyway: the pool shrinks to 2 by draining
    assert flips.settle(planned, cur, o, 0, 2) == planned
    assert flips.settle(planned, cur, o, 0, None) == planned  # the spec's sizes: the spec rules
    # a decision's growth of the target stands (pods for failed flips) ...
    assert flips.settle(planned, cur, o, 1, 4, 3) == {"prefill": 3, "decode": 3}
    # ... but a flip-only step (autoscaler_flip_window: the target's size before flips is its size now) starts
    # no pod for a flip that failed: the target grows by what flipped
    assert flips.settle(planned, cur, o, 1, 4, 1) == {"prefill": 3, "decode": 2}
    assert flips.settle(planned, cur, o, 0, 4, 1) == {"prefill": 4, "decode": 1}
    assert flips.deployment_replicas({"prefill": 2, "decode": 3}, {"prefill": 0, "decode": 2}) == \
        {"prefill": 2, "decode": 1}


def test_which_pods_flip_and_which_go_first() -> None:
    pods = [pod("a", "prefill"), pod("b", "prefill", ready=False), pod("c", "prefill", ip=None),
            pod("d", "prefill", draining=True), pod("e", "prefill", flipped_from="decode")]
    assert [p["metadata"]["name"] for p in flips.pick_flippers(pods, 5)] == ["e", "a"]
    assert [p["metadata"]["name"] for p in flips.retire_first(pods, 5)] == ["e"]
    patch = flips.relabel_patch(OWNER, "prefill", "decode", "now")
    labels = patch["metadata"]["labels"]
    assert labels[naming.ROLE_LABEL] == labels["llm-d.ai/role"] == labels["app.kubernetes.io/component"] == "decode"
    assert labels[flips.FLIPPED] == "prefill"
    assert patch["metadata"]["ownerReferences"] == [naming.owner_reference(OWNER)]  # no ReplicaSet's any more


def test_an_autoscaler_flip_is_explained_as_flip() -> None:
    pol = policy(max_up_step=100)
    dec = asc.decide(pol, asc.State(), obs(4, i=400, o=900), asc.PoolView(5, 5), asc.PoolView(2, 2), 0.0)
    flipped = aflip.applied(dec, pol)
    fp = aflip.plan(dec, pol)
    assert flipped.reason == aflip.FLIP and (flipped.prefill.desired, flipped.decode.desired) == (fp.prefill, fp.decode)
    assert explain.causes(flipped) == {"prefill": "flip", "decode": "flip"}
    assert "(flip)" in explain.message(flipped)
    assert st.decision_record(flipped, "t")["prefill"]["cause"] == "flip"
    steady = asc.decide(pol, asc.State(), obs(1), asc.PoolView(1, 1), asc.PoolView(1, 1), 0.0)
    assert aflip.applied(steady, pol) is steady  # nothing to flip: the decision as it was


# ------------------------------------------------------------------ a reconcile pass
class PodKube:
    """A recording API with pods and Deployments: apply stores, merge_patch on a Pod updates its labels,
    annotations and owner references, list selects pods by label, delete removes."""

    def __init__(self, pods: list[dict[str, Any]], replicas: dict[str, int]) -> None:
        self.pods = {p["metadata"]["name"]: p for p in pods}
        self.deps = {naming.child_name(OWNER, r): {"metadata": {"creationTimestamp": "2026-01-01T00:00:00Z"},
                                                    "spec": {"replicas": n}, "status": {"replicas": n,
                                                                                        "readyReplicas": n}}
                     for r, n in replicas.items()}
        self.calls: list[tuple[str, Any]] = []
        self.host = "fake"

    async def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        if kind == "Secret":
            return {"data": {"key": base64.b64encode(KEY).decode()}}
        return self.deps.get(name) if kind == "Deployment" else None

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        return obj

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("apply", (obj["kind"], obj["metadata"]["name"], (obj.get("spec") or {}).get("replicas"))))
        if obj["kind"] == "Deployment":  # as if its ReplicaSet had settled: every replica ready
            n = obj["spec"]["replicas"]
            return {**obj, "status": {"replicas": n, "readyReplicas": n, "updatedReplicas": n, "availableReplicas": n}}
        return obj

    async def list(self, api_version: str, kind: str, namespace: str | None,
                   label_selector: dict[str, str] | None = None) -> list[dict[str, Any]]:
        sel = label_selector or {}
        return [copy.deepcopy(p) for p in self.pods.values()
                if all(p["metadata"]["labels"].get(k) == v for k, v in sel.items())]

    async def merge_patch(self, api_version: str, kind: str, namespace: str | None, name: str,
                          patch: dict[str, Any], subresource: str | None = None) -> dict[str, Any]:
        self.calls.append(("merge_patch", (kind, name, subresource)))
        if kind == "Deployment":
            self.deps[name]["spec"]["replicas"] = patch["spec"]["replicas"]
        if kind == "Pod":
            meta = self.pods[name]["metadata"]
            meta["labels"].update(patch["metadata"].get("labels") or {})
            meta["annotations"].update(patch["metadata"].get("annotations") or {})
            if "ownerReferences" in patch["metadata"]:
                meta["ownerReferences"] = patch["metadata"]["ownerReferences"]
        return patch

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        self.calls.append(("delete", (kind, name)))
        return self.pods.pop(name, None) is not None

    def replicas(self) -> dict[str, int]:
        return {name: n for verb, (kind, name, n) in [c for c in self.calls if c[0] == "apply"]
                if kind == "Deployment" and name != "demo-router"}


@pytest.mark.timeout(180)
async def test_reconcile_flips_a_pod_the_spec_moves_and_retires_it_first(tiny_model_dir: Path) -> None:
    """With autoscaling off, prefill 2 -> 1 and decode 1 -> 2 in one edit is a flip, not a pod stopped and
    one started, with no `roleFlips` in the spec (the default): the worker (real, tiny model) serves as decode,
    its pod carries the decode labels and the PDCluster as owner, prefill's Deployment runs 1 and decode's 1
    (+ the flipped pod), and a RoleFlip Event says so. Decode back to 1 then removes the flipped pod first,
    drained, and the Deployments keep theirs."""
    app, _ = make_worker(tiny_model_dir, "prefill", secret=KEY)
    with serve(app) as url:
        port = int(url.rsplit(":", 1)[1])
        pods = [pod("demo-prefill-a", "prefill", ip="127.0.0.1", port=port),
                pod("demo-prefill-b", "prefill", ip="192.0.2.1"),  # an address nobody answers on: not picked
                pod("demo-decode-a", "decode", ip="192.0.2.2")]
        pods[1]["status"]["conditions"][0]["status"] = "False"
        kube = PodKube(pods, {"prefill": 2, "decode": 1})
        events: list[tuple[str, str, str]] = []
        async with httpx.AsyncClient(trust_env=False) as http:
            ctx = rec.Context(kube=kube, emit=lambda body, t, reason, msg: events.append((t, reason, msg)),  # type: ignore[arg-type]
                              now=lambda: 1_800_000_000.0, http=http)
            body = make_body(spec=make_spec(prefill={"replicas": 1, "minReplicas": 1, "maxReplicas": 4},
                                            decode={"replicas": 2, "minReplicas": 1, "maxReplicas": 8}),
                             status={"observedGeneration": 1})
            before = opmetrics.REGISTRY.get_sample_value("pdcluster_operator_reconciles_total",
                                                         {"trigger": "resync", "result": "ok"}) or 0.0
            out = await rec.reconcile(ctx, body, "resync")
            assert not out.degraded
            assert opmetrics.REGISTRY.get_sample_value("pdcluster_operator_reconciles_total",
                                                       {"trigger": "resync", "result": "ok"}) == before + 1
            health = httpx.get(f"{url}/health").json()
            assert health["role"] == "decode" and health["status"] == "ok"  # the same process, now decode
            meta = kube.pods["demo-prefill-a"]["metadata"]
            assert meta["labels"][naming.ROLE_LABEL] == "decode" and meta["labels"][flips.FLIPPED] == "prefill"
            assert meta["ownerReferences"][0]["kind"] == "PDCluster"
            # the template it was made from, so a later upgrade replaces it (test_flip_default.py)
            assert meta["annotations"][flips.ORIGIN].startswith("prefill/")
            assert kube.replicas() == {"demo-prefill": 1, "demo-decode": 1}  # no ReplicaSet starts or stops a pod
            patches = [c[1][:2] for c in kube.calls if c[0] == "merge_patch"]
            # the prefill Deployment drops by one right after the relabel (its ReplicaSet must not replace it)
            assert patches[patches.index(("Pod", "demo-prefill-a")) + 1] == ("Deployment", "demo-prefill")
            assert kube.deps["demo-prefill"]["spec"]["replicas"] == 1
            assert [e[1] for e in events if e[1].startswith("RoleFlip")] == ["RoleFlip"]
            assert "demo-prefill-a" in events[[e[1] for e in events].index("RoleFlip")][2]
            assert not [c for c in kube.calls if c[0] == "merge_patch" and c[1][1] != "demo-prefill-a"
                        and c[1][0] == "Pod"]  # nobody drained: nothing stopped

            # the status counts the flipped pod in decode: 2 of 2 ready, the PDCluster Ready
            status = out.status or {}
            assert (status["decode"]["replicas"], status["decode"]["readyReplicas"]) == (2, 2), status["decode"]
            assert (status["decode"]["flippedReplicas"], status["prefill"]["flippedReplicas"]) == (1, 0)
            assert [c["status"] for c in status["conditions"] if c["type"] == "Ready"] == ["True"]
            (cond,) = [c for c in status["conditions"] if c["type"] == "RoleFlips"]
            assert (cond["status"], cond["reason"], cond["observedGeneration"]) == ("True", "PoolsInterchangeable", 1)

            # The next pass, nothing changes: the flipped pod counts in decode, the Deployments stay.
            kube.calls.clear()
            await rec.reconcile(ctx, body, "resync")
            assert kube.replicas() == {"demo-prefill": 1, "demo-decode": 1}
            assert not [c for c in kube.calls if c[0] == "delete"]

            # Decode back to 1: the flipped pod goes first (drained, deleted), the Deployments keep theirs.
            kube.calls.clear()
            body2 = copy.deepcopy(body)
            body2["spec"]["decode"]["replicas"] = 1
            await rec.reconcile(ctx, body2, "resync")
            assert ("delete", ("Pod", "demo-prefill-a")) in kube.calls
            assert health and httpx.get(f"{url}/health").json()["status"] == "draining"  # drained before it went
            assert kube.replicas() == {"demo-prefill": 1, "demo-decode": 1}
