"""Role flips are the operator's default (issue 37 item 3): `spec.roleFlips` is true unless a user says false,
flips are used wherever the pools' pods are interchangeable, and where they are not the operator falls back to
starting pods and says why in the `RoleFlips` condition (reason, message, observedGeneration). A flipped pod
that a pod of its pool would not be now (flips turned off, an image upgrade) is replaced, surge first."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pdcluster.operator import flips, models, naming, render, scaling
from pdcluster.operator import reconcile as rec
from pdcluster.operator import status as st
from pdcluster.operator.models import parse_spec

from ..disagg.harness import make_worker, serve
from .conftest import make_body, make_spec
from .test_autoscaler_guards import obs
from .test_flips import KEY, PodKube, pod

ROOT = Path(__file__).resolve().parents[2]
GPU = {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}}


def test_the_default_is_on_in_the_model_and_the_committed_crds() -> None:
    assert models.PDClusterSpec.model_fields["roleFlips"].default is True
    assert parse_spec(make_spec()).roleFlips is True
    for path in ("crds/pdcluster.yaml", "helm/pdcluster-operator/crds/pdcluster.yaml"):
        crd = yaml.safe_load((ROOT / path).read_text())
        props = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
        assert props["spec"]["properties"]["roleFlips"]["default"] is True, path
        assert "flippedReplicas" in props["status"]["properties"]["decode"]["properties"], path


# each way the pools' pods stop being interchangeable -> the condition's reason (and a word of its message)
BLOCKED = [
    ("off", {"roleFlips": False}, "Disabled", "roleFlips is false"),
    ("vllm", {"engine": "vllm", "kvTransfer": {"integrity": "fabric"}},
     "EngineUnsupported", "engine vllm"),
    ("tp", {"prefill": {"replicas": 1, "tensorParallelSize": 2}, "decode": {"replicas": 1}},
     "LayoutsDiffer", "tensorParallelSize 2"),
    ("gpus", {"decode": {"replicas": 1, "resources": GPU}}, "LayoutsDiffer", "GPUs per pod"),
    ("resources", {"decode": {"replicas": 1, "resources": {"requests": {"cpu": "3"}}}},
     "ResourcesDiffer", "resources differ"),
    ("image", {"decode": {"replicas": 1, "image": "registry.example/other:1"}}, "ImagesDiffer", "other:1"),
    ("engine-args", {"decode": {"replicas": 1, "engineArgs": ["--threads", "2"]}}, "PodSpecsDiffer", "engineArgs"),
    ("env", {"prefill": {"replicas": 1, "env": [{"name": "A", "value": "1"}]}}, "PodSpecsDiffer", "env"),
    ("affinity", {"decode": {"replicas": 1, "affinity": {"nodeAffinity": {}}}}, "PodSpecsDiffer", "affinity"),
    ("priority", {"decode": {"replicas": 1, "priorityClassName": "high"}}, "PodSpecsDiffer", "priorityClassName"),
]


@pytest.mark.parametrize("overrides,reason,word", [b[1:] for b in BLOCKED], ids=[b[0] for b in BLOCKED])
def test_why_flips_are_off(overrides: dict[str, Any], reason: str, word: str) -> None:
    s = parse_spec(make_spec(**overrides))
    b = flips.blocked(s)
    assert b is not None and b.reason == reason and word in b.message, b
    assert flips.incompatible(s) == b.message
    c = flips.condition(s)
    assert (c["type"], c["status"], c["reason"], c["message"]) == ("RoleFlips", "False", reason, b.message)
    # no flip whatever the sizes: the growing pool starts pods, the shrinking one drains
    assert flips.order(s, {"prefill": 3, "decode": 1}, {"prefill": 2, "decode": 2}) is None


def test_interchangeable_pools_flip_by_default() -> None:
    """Same image (one given per pool counts), resources, layout and pod options, or differences that do not
    shape the running process (pod annotations, pull secrets): flips are on."""
    same = {"requests": {"cpu": "500m"}}
    for spec in (make_spec(),
                 make_spec(prefill={"replicas": 1, "resources": same, "image": "ghcr.io/example/pdcluster:0.1.0"},
                           decode={"replicas": 1, "resources": same, "podAnnotations": {"team": "llm"},
                                   "imagePullSecrets": [{"name": "registry"}]}),
                 make_spec(prefill={"replicas": 1, "resources": GPU}, decode={"replicas": 1, "resources": GPU})):
        s = parse_spec(spec)
        assert flips.blocked(s) is None, flips.blocked(s)
        c = flips.condition(s)
        assert (c["status"], c["reason"]) == ("True", "PoolsInterchangeable")
        assert flips.order(s, {"prefill": 3, "decode": 1}, {"prefill": 2, "decode": 2}) == \
            flips.Order("prefill", "decode", 1)


def test_the_autoscaler_flips_by_default_and_not_when_blocked() -> None:
    """A decision that grows prefill while decode has slack is carried out by flips with the default spec; with
    the pools' resources apart it is the decision as decided (pods start) and nothing is planned as a flip."""
    auto = {"enabled": True, "prometheusUrl": "http://prom:9090", "maxScaleUpStep": 100,
            "capacity": {"prefillTokensPerSecond": 10000, "decodeTokensPerSecond": 2000}}
    pools = scaling.Pools({"prefill": 1, "decode": 5}, {"prefill": 1, "decode": 5}, {"prefill": 0.0, "decode": 0.0})
    observed = scaling.Observed(obs(4, i=4000, o=20), "QueriesSucceeded", "ok")
    base = {"prefill": 1, "decode": 5}

    def step(**decode: Any) -> scaling.Step:
        s = parse_spec(make_spec(autoscaling=auto, prefill={"minReplicas": 1, "maxReplicas": 8},
                                 decode={"minReplicas": 1, "maxReplicas": 8, **decode}))
        return scaling.evaluate(s, base, pools, {}, observed, 1_000.0)

    flipped, blocked = step(), step(resources={"requests": {"cpu": "3"}})
    assert flipped.decision is not None and blocked.decision is not None
    assert flipped.decision.prefill.desired > 1, flipped.decision  # prefill is short
    assert flipped.decision.reason == "RoleFlip" and flipped.before_flips is not None
    assert flipped.desired["decode"] < 5  # the slack moved to prefill
    assert blocked.decision.reason != "RoleFlip" and blocked.before_flips is None
    assert blocked.desired["decode"] == blocked.decision.decode.desired
    assert blocked.decision.prefill.desired == flipped.decision.prefill.desired


async def _pass(kube: PodKube, body: dict[str, Any], http: httpx.AsyncClient,
                events: list[tuple[str, str, str]]) -> rec.Outcome:
    ctx = rec.Context(kube=kube, emit=lambda b, t, reason, msg: events.append((t, reason, msg)),  # type: ignore[arg-type]
                      now=lambda: 1_800_000_000.0, http=http)
    out = await rec.reconcile(ctx, body, "resync")
    assert not out.degraded, out.degraded
    return out


def _cond(out: rec.Outcome) -> dict[str, Any]:
    (c,) = [c for c in out.status["conditions"] if c["type"] == "RoleFlips"]
    return c


@pytest.mark.timeout(180)
async def test_pools_not_interchangeable_start_pods_and_say_why(tiny_model_dir: Path) -> None:
    """prefill 2 -> 1 and decode 1 -> 2 with decode's resources apart: the worker that would have flipped is not
    asked (it is still a prefill worker), no pod is relabelled, the prefill pool drains a victim and the decode
    Deployment grows; `RoleFlips` is False with reason ResourcesDiffer for this generation."""
    app, _ = make_worker(tiny_model_dir, "prefill", secret=KEY)
    with serve(app) as url:
        port = int(url.rsplit(":", 1)[1])
        pods = [pod("demo-prefill-a", "prefill", ip="127.0.0.1", port=port),
                pod("demo-prefill-b", "prefill", ready=False, ip=None),  # the victim: not ready, no address
                pod("demo-decode-a", "decode", ip=None)]
        kube = PodKube(pods, {"prefill": 2, "decode": 1})
        events: list[tuple[str, str, str]] = []
        body = make_body(spec=make_spec(prefill={"replicas": 1, "minReplicas": 1, "maxReplicas": 4},
                                        decode={"replicas": 2, "minReplicas": 1, "maxReplicas": 8,
                                                "resources": {"requests": {"cpu": "2"}}}),
                         generation=3, status={"observedGeneration": 2})
        async with httpx.AsyncClient(trust_env=False) as http:
            out = await _pass(kube, body, http, events)
        assert httpx.get(f"{url}/health").json()["role"] == "prefill"  # never asked to flip
        assert flips.FLIPPED not in kube.pods["demo-prefill-a"]["metadata"]["labels"]
        assert kube.replicas() == {"demo-prefill": 1, "demo-decode": 2}  # a pod stops, a pod starts
        assert ("merge_patch", ("Pod", "demo-prefill-b", None)) in kube.calls  # drained as a victim
        assert not [e for e in events if e[1].startswith("RoleFlip")]
        c = _cond(out)
        assert (c["status"], c["reason"], c["observedGeneration"]) == ("False", "ResourcesDiffer", 3)
        assert "resources differ" in c["message"]
        assert out.status["prefill"]["flippedReplicas"] == out.status["decode"]["flippedReplicas"] == 0


class RollingKube(PodKube):
    """PodKube whose Deployments, while `rolling`, have one replica short of ready (a pod still starting)."""

    rolling = True

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        out = await super().apply(obj)
        if obj["kind"] == "Deployment" and self.rolling:
            n = obj["spec"]["replicas"]
            out = {**out, "status": {"replicas": n, "readyReplicas": n - 1, "updatedReplicas": n}}
        return out


def _flipped(name: str, role: str, source: str, origin: str | None) -> dict[str, Any]:
    p = pod(name, role, flipped_from=source, ip=None)
    p["metadata"]["ownerReferences"] = [naming.owner_reference(naming.Owner("demo", "ns1", "uid-demo"))]
    if origin:
        p["metadata"]["annotations"][flips.ORIGIN] = origin
    return p


async def test_flipped_pods_are_replaced_after_flips_are_turned_off() -> None:
    """A pod flipped to prefill while flips were on; then `roleFlips: false`: the pod no longer counts, so the
    prefill Deployment starts its replacement; the flipped pod keeps serving until that Deployment has every
    replica ready, then it is drained and removed (a FlippedPodReplaced Event says why). No flip is made."""
    kube = RollingKube([pod("demo-prefill-a", "prefill", ip=None), _flipped("demo-decode-x", "prefill", "decode", None),
                        pod("demo-decode-a", "decode", ip=None)], {"prefill": 1, "decode": 1})
    spec = make_spec(roleFlips=False, prefill={"replicas": 2, "minReplicas": 1, "maxReplicas": 4},
                     decode={"replicas": 1, "minReplicas": 1, "maxReplicas": 8})
    body = make_body(spec=spec, status={"observedGeneration": 1})
    events: list[tuple[str, str, str]] = []
    async with httpx.AsyncClient(trust_env=False) as http:
        out = await _pass(kube, body, http, events)
        assert kube.replicas() == {"demo-prefill": 2, "demo-decode": 1}  # the replacement starts
        assert "demo-decode-x" in kube.pods  # still serving: the replacement is not ready
        # the status shows what runs: 3 prefill pods, 1 of them flipped
        assert (out.status["prefill"]["replicas"], out.status["prefill"]["flippedReplicas"]) == (3, 1)
        assert (_cond(out)["status"], _cond(out)["reason"]) == ("False", "Disabled")

        kube.rolling = False  # the replacement is Ready: the next pass removes the flipped pod
        kube.calls.clear()
        out = await _pass(kube, body, http, events)
    assert ("delete", ("Pod", "demo-decode-x")) in kube.calls and "demo-prefill-a" in kube.pods
    assert kube.replicas() == {"demo-prefill": 2, "demo-decode": 1}
    assert out.status["prefill"]["flippedReplicas"] == 0
    (replaced,) = [e for e in events if e[1] == "FlippedPodReplaced"]
    assert replaced[0] == "Normal" and "demo-decode-x" in replaced[2] and "roleFlips is false" in replaced[2]
    assert not [e for e in events if e[1].startswith("RoleFlip")]


def test_a_flipped_pod_is_stale_when_its_template_changed() -> None:
    """The template a flipped pod was made from is recorded at its first flip; an image upgrade (any change of
    the pod template but the batch limits, which a flip sets) makes it stale, as flips turned off do."""
    owner = naming.Owner("demo", "ns1", "uid-demo")
    base = parse_spec(make_spec())
    hashes = flips.template_hashes(owner, base, "fp")
    origin = flips.origin_of("prefill", hashes)
    assert flips.relabel_patch(owner, "prefill", "decode", "now", origin)["metadata"]["annotations"][flips.ORIGIN] \
        == origin
    limits = parse_spec(make_spec(prefill={"replicas": 1, "maxBatchSize": 3}, decode={"replicas": 2,
                                                                                      "maxBatchTokens": 77}))
    assert flips.template_hashes(owner, limits, "fp") == hashes
    upgraded = flips.template_hashes(owner, parse_spec(make_spec(image="ghcr.io/example/pdcluster:0.2.0")), "fp")
    assert upgraded["prefill"] != hashes["prefill"] and upgraded["decode"] != hashes["decode"]

    current = _flipped("p", "decode", "prefill", origin)
    assert not flips.stale(current, hashes, flips_blocked=False)
    assert flips.stale(current, upgraded, flips_blocked=False)
    assert flips.stale(current, hashes, flips_blocked=True)
    assert not flips.stale(_flipped("q", "decode", "prefill", None), upgraded, flips_blocked=False)  # unknown: kept
    assert not flips.stale(pod("r", "decode"), upgraded, flips_blocked=True)  # not flipped


async def test_an_upgrade_replaces_flipped_pods_surge_first() -> None:
    """A decode pod that came from prefill, then the image changes: it is replaced by a pod of the decode
    Deployment (which the upgrade rolls anyway), removed once that Deployment is rolled out and ready."""
    owner = naming.Owner("demo", "ns1", "uid-demo")
    old = flips.template_hashes(owner, parse_spec(make_spec()), render.secret_fingerprint(KEY))
    kube = RollingKube([pod("demo-prefill-a", "prefill", ip=None), pod("demo-decode-a", "decode", ip=None),
                        _flipped("demo-prefill-x", "decode", "prefill", flips.origin_of("prefill", old))],
                       {"prefill": 1, "decode": 1})
    kube.rolling = False
    body = make_body(spec=make_spec(prefill={"replicas": 1, "minReplicas": 1, "maxReplicas": 4},
                                    decode={"replicas": 2, "minReplicas": 1, "maxReplicas": 8}),
                     status={"observedGeneration": 1})
    events: list[tuple[str, str, str]] = []
    async with httpx.AsyncClient(trust_env=False) as http:
        await _pass(kube, body, http, events)  # the same template: the flipped pod counts in decode
        assert kube.replicas() == {"demo-prefill": 1, "demo-decode": 1} and "demo-prefill-x" in kube.pods
        upgraded = copy.deepcopy(body)
        upgraded["spec"]["image"] = "ghcr.io/example/pdcluster:0.2.0"
        upgraded["metadata"]["generation"] = 2
        kube.rolling = True
        await _pass(kube, upgraded, http, events)
        assert kube.replicas() == {"demo-prefill": 1, "demo-decode": 2} and "demo-prefill-x" in kube.pods
        kube.rolling = False
        await _pass(kube, upgraded, http, events)
    assert "demo-prefill-x" not in kube.pods
    assert kube.replicas() == {"demo-prefill": 1, "demo-decode": 2}
    assert [e[1] for e in events if e[1] == "FlippedPodReplaced"] == ["FlippedPodReplaced"]


def test_the_condition_is_a_declared_type_and_exported() -> None:
    assert "RoleFlips" in st.CONDITION_TYPES
    merged = st.merge_conditions(None, [flips.condition(parse_spec(make_spec()))], "t", 7)
    assert merged == [{"type": "RoleFlips", "status": "True", "reason": "PoolsInterchangeable",
                       "message": merged[0]["message"], "lastTransitionTime": "t", "observedGeneration": 7}]
